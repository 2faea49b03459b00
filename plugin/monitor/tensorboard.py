"""``train.py --tensorboard DIR``: each step's numbers as TensorBoard scalars through torch's ``SummaryWriter``
(rank 0), with the recipe and the resolved layout as text. Needs the ``tensorboard`` package
(``pip install 'parallel-recipe[monitor]'``): :func:`missing` says so in one line before anything starts.

A resumed run (``--resume``) continues DIR as one timeline, as ``--metrics`` does: SummaryWriter's ``purge_step``
hides the steps after the checkpoint's that an earlier run logged there (else TensorBoard draws both, the line
running back from the interrupted run's last step to the checkpoint's).
"""
from __future__ import annotations

import importlib.util
import json

INSTALL = "pip install 'parallel-recipe[monitor]' (tensorboard and matplotlib)"


def missing() -> str | None:
    """None when TensorBoard can be written, else the one line that says what to install."""
    if importlib.util.find_spec("tensorboard") is None:
        return f"--tensorboard needs the tensorboard package -> {INSTALL}"
    return None


# StepReport field -> scalar tag
TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens_per_s": "perf/tokens_per_s",
        "step_time_s": "perf/step_time_s", "memory_gb": "perf/memory_gb", "mfu": "perf/mfu"}


class TensorBoard:
    """``resumed_at``: None for a fresh run; the checkpoint's step for a resumed one (later steps are purged)."""

    def __init__(self, logdir: str, recipe, layout: dict, *, resumed_at: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=logdir, purge_step=None if resumed_at is None else resumed_at + 1)
        self.writer.add_text("recipe", "```json\n" + json.dumps(recipe.to_dict(), indent=2) + "\n```", 0)
        self.writer.add_text("layout", "  \n".join(f"{k}: {v}" for k, v in layout.items()), 0)

    def write(self, report, eval_loss: float | None = None) -> None:
        for field, tag in TAGS.items():
            value = getattr(report, field)
            if value is not None:
                self.writer.add_scalar(tag, value, report.step)
        if eval_loss is not None:
            self.writer.add_scalar("eval/loss", eval_loss, report.step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
