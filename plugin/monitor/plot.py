"""``python -m plugin plot METRICS... -o FILE.png``: loss, eval loss and learning rate against step, several runs
overlaid (e.g. two layouts of one recipe), drawn with matplotlib (``pip install 'parallel-recipe[monitor]'``). Pure: no
torch. Each METRICS is a ``train.py --metrics`` file (:mod:`.metrics`); its name labels its lines.
"""
from __future__ import annotations

from pathlib import Path

INSTALL = "pip install 'parallel-recipe[monitor]' (tensorboard and matplotlib)"


def missing() -> str | None:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return f"plot needs matplotlib -> {INSTALL}"
    return None


def plot_runs(runs: dict[str, list[dict]], output: str, title: str = "") -> None:
    """Draw ``{label: records}`` into ``output`` (PNG, or any format matplotlib infers from the suffix)."""
    import matplotlib.pyplot as plt

    fig = draw_runs(runs, title)
    try:
        fig.savefig(output, dpi=110)
    finally:
        plt.close(fig)


def draw_runs(runs: dict[str, list[dict]], title: str = ""):
    """The figure of ``{label: records}`` (what :func:`plot_runs` saves): loss and eval loss on the top axes (lines
    labelled ``LABEL: loss`` and ``LABEL: eval loss``), the learning rate on the bottom ones (labelled ``LABEL``)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True, height_ratios=(2, 1), layout="constrained")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, records) in enumerate(runs.items()):
        # later runs thinner, on top: runs that agree (two layouts of one recipe) show as a thin line on a thick one
        c, lw, marker = colours[i % len(colours)], max(1.0, 3.2 - 1.1 * i), "osD^v"[i % 5]
        steps = [r["step"] for r in records if r.get("loss") is not None]
        top.plot(steps, [r["loss"] for r in records if r.get("loss") is not None], color=c, lw=lw,
                 label=f"{label}: loss")
        evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
        if evals:
            top.plot(*zip(*evals, strict=True), color=c, ls="--", marker=marker, ms=7 - 1.5 * min(i, 3), lw=lw / 2,
                     label=f"{label}: eval loss")
        lrs = [(r["step"], r["lr"]) for r in records if r.get("lr") is not None]
        if lrs:
            bottom.plot(*zip(*lrs, strict=True), color=c, lw=lw, label=label)
    top.set_ylabel("loss")
    top.grid(alpha=0.3)
    top.legend(fontsize=8)
    top.set_title(title or "training runs")
    bottom.set_ylabel("learning rate")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    bottom.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    return fig


def labels_for(paths: list[str]) -> list[str]:
    """Each file's stem, or its path where two stems are the same."""
    stems = [Path(p).stem for p in paths]
    return [s if stems.count(s) == 1 else str(p) for s, p in zip(stems, paths, strict=True)]
