"""The monitor room without processes: the step record and MFU, the console line, the metrics file, the chatter
filter, TensorBoard, the plot and the rank map."""
import io
import json
import logging
import re
import time
import xml.etree.ElementTree as ET
from typing import NamedTuple

import pytest

from plugin.distributed.topology import Topology
from plugin.monitor.console import Console, step_line
from plugin.monitor.metrics import MetricsFile, read_metrics
from plugin.monitor.quiet import LineFilter, quiet_engines
from plugin.monitor.rank_map import axes_of, rank_map_svg
from plugin.monitor.record import METRIC_KEYS, StepReport, device_peak_flops, mfu, model_flops_per_token
from plugin.recipe.checks import load_recipe


def _report(step=3, **more):
    values = dict(step=step, loss=3.25, lr=3e-4, grad_norm=0.75, tokens=1024, step_time_s=0.5, tokens_per_s=2048.0,
                  memory_gb=1.5, mfu=None)
    return StepReport(**{**values, **more})


def test_the_record_and_mfu_are_the_planners():
    assert list(_report().to_json()) == list(METRIC_KEYS)
    from plugin.planning.for_recipe import setup_from_recipe, spec_from_recipe
    from plugin.planning.steptime import model_flops_per_step

    recipe = load_recipe("tp2_dp4")
    per_token = model_flops_per_token(recipe)
    setup = setup_from_recipe(recipe)
    assert per_token * setup.global_batch * recipe.model.seq_len == pytest.approx(
        model_flops_per_step(spec_from_recipe(recipe), setup))
    peak = device_peak_flops("NVIDIA H200", "bf16")
    assert peak == 989e12 and device_peak_flops("NVIDIA H100 80GB HBM3", "fp32") == 989e12 / 2
    assert mfu(per_token, 10_000, 1.0, 8, peak) == pytest.approx(per_token * 1e4 / (8 * 989e12))
    assert mfu(None, 1, 1.0, 1, peak) is None and mfu(per_token, 1, 1.0, 1, None) is None


def test_the_console_line_and_when_it_is_printed():
    line = step_line(_report(mfu=0.412), total=50, elapsed=65, eta=3725, width=200)
    assert line == ("step 3/50  loss 3.2500  lr 3.00e-4  grad 0.75  2.05k tok/s  MFU 41.2%  mem 1.50 GB  1:05  "
                    "ETA 1:02:05")
    assert "MFU -" in step_line(_report(), 50, 0, None, 200) and "ETA -" in step_line(_report(), 50, 0, None, 200)
    out = io.StringIO()  # not a terminal: a line every log_every steps and the last one, evaluations after theirs
    console = Console(total=7, start=0, log_every=3, stream=out)
    for s in range(1, 8):
        console.write(_report(step=s), eval_loss=2.5 if s == 4 else None)
    console.close()
    steps = [line.split()[1] for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert steps == ["3/7", "6/7", "7/7"] and "eval at step 4: loss 2.5000" in out.getvalue()
    assert max(len(line) for line in out.getvalue().splitlines()) <= 80  # a plain line too (| tee in a terminal)
    quiet = io.StringIO()
    Console(total=7, start=0, enabled=False, stream=quiet).write(_report())
    assert quiet.getvalue() == ""


@pytest.mark.parametrize("report, total, elapsed, eta, kept", [
    # the README's run: at 80 columns the unknown MFU, the elapsed time and the learning rate go
    (_report(step=20, loss=3.0395, lr=1.95e-3, grad_norm=2.99, tokens_per_s=21_080, memory_gb=0.39), 40, 1, 1,
     "step 20/40  loss 3.0395  grad 2.99  21.1k tok/s  mem 0.39 GB  ETA 0:01"),
    # a GPU run of half a million steps: the MFU is known and stays; the elapsed time, the lr and the memory go
    (_report(step=123_456, loss=2.4512, lr=2.95e-4, grad_norm=0.312, tokens_per_s=1_234_567, memory_gb=61.2,
             mfu=0.412), 500_000, 3 * 86400 + 5, 9 * 86400,
     "step 123456/500000  loss 2.4512  grad 0.312  1.23M tok/s  MFU 41.2%  ETA 9d00h"),
    # everything at its longest: the step, the loss and the ETA always stay
    (_report(step=12_345_678, loss=123_456.789, lr=0.1234, grad_norm=1e30, tokens_per_s=9.99e15, memory_gb=12_345.6,
             mfu=1.5), 99_999_999, 1e9, 1e10,
     "step 12345678/99999999  loss 1.2346e5  9990T tok/s  MFU 150.0%  ETA 115740d17h"),
    (_report(loss=float("nan"), lr=None, grad_norm=float("inf"), memory_gb=None, tokens_per_s=0.0), 10**9, 0, None,
     "step 3/1000000000  loss nan  grad inf  0 tok/s  ETA -"),
])
def test_the_console_line_fits_80_columns(report, total, elapsed, eta, kept):
    """Every line fits 80 columns: numbers written short, then the fields least needed go, always in one order, the
    order of the line kept (the README's line was 97 characters)."""
    line = step_line(report, total, elapsed, eta)
    assert len(line) <= 80 and line == kept
    from plugin.monitor.console import step_fields

    every = [text for _, text in step_fields(report, total, elapsed, eta)]
    assert step_line(report, total, elapsed, eta, width=1000) == "  ".join(every)  # a wide terminal: every field
    assert line.split("  ") == [text for text in every if text in line.split("  ")]


def test_a_run_keeps_its_fields_from_step_to_step():
    """Fields are counted at the width their numbers usually grow to: a line does not gain or lose a field when the
    gradient norm goes from 2.99 to 0.816, the throughput from 845 to 21.1k, or the step from 9 to 10."""
    shapes = set()
    steps = [(1, 2.99, 845, None), (9, 0.816, 21_080, 100), (10, 12.3, 1.62e3, 1), (40, 0.5, 5e4, 0)]
    for step, grad, speed, eta in steps:
        line = step_line(_report(step=step, grad_norm=grad, tokens_per_s=speed), 40, step, eta)
        shapes.add(tuple(re.sub(r"[-\d.:]+[kMG]?", "N", line).split("  ")))
    assert shapes == {("step N/N", "loss N", "grad N", "N tok/s", "mem N GB", "ETA N")}


def test_numbers_written_short():
    from plugin.monitor.console import _clock, _number, _throughput

    assert [_throughput(v) for v in (0, 845, 999.4, 999.6, 21_080, 211_000, 999_960, 1.23e6, 5e15)] == \
        ["0", "845", "999", "1.00k", "21.1k", "211k", "1.00M", "1.23M", "5000T"]
    assert [_number(v) for v in (0, 2.99, 0.312, 123.4, 999.6, 12_345.6, 3e-5, float("inf"))] == \
        ["0", "2.99", "0.312", "123", "1.0e3", "1.2e4", "3.0e-5", "inf"]
    assert [_clock(v) for v in (0, 65, 3725, 86_399, 3 * 86_400 + 4 * 3600)] == \
        ["0:00", "1:05", "1:02:05", "23:59:59", "3d04h"]


def test_the_live_line_on_a_terminal():
    out = io.StringIO()
    console = Console(total=3, start=0, stream=out, live=True)
    for s in range(1, 4):
        console.write(_report(step=s), eval_loss=2.0 if s == 2 else None)
    console.close()
    text = out.getvalue()
    assert "step 3/3" in text and "eval at step 2: loss 2.0000" in text
    assert text.count("eval at step 2") == 1  # printed once, above the line, which is redrawn in place


@pytest.mark.parametrize("columns", [60, 80, 132])
def test_the_live_line_fits_its_terminal(columns):
    """On a terminal (a pseudo-terminal of ``columns``) the live line is as wide as the terminal allows; a plain line
    keeps to 80 whatever the terminal."""
    import fcntl
    import os
    import struct
    import termios

    leader, follower = os.openpty()
    try:
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
        with open(follower, "w", closefd=False) as tty:
            live = Console(total=500_000, start=0, stream=tty)
            live.write(_report(step=1))
            assert live.live_line and live.width == live._live.console.width == columns
            live.close()
            assert Console(total=500_000, start=0, stream=tty, live=False).width == 80
    finally:
        os.close(leader)
        os.close(follower)
    line = step_line(_report(step=123_456, mfu=0.41), 500_000, 3725, 9e5, width=columns)
    assert len(line) <= columns and ("mem 1.50 GB" in line) == (columns >= 132)


def test_metrics_file_writes_the_issues_keys(tmp_path):
    path = tmp_path / "m-{rank}.jsonl"
    m = MetricsFile(str(path), 3, resumed_at=None)
    m.write(_report(step=1))
    m.write(_report(step=2), eval_loss=2.5)
    m.close()
    records = read_metrics(tmp_path / "m-3.jsonl")
    assert list(records[0]) == list(METRIC_KEYS) and records[1]["eval_loss"] == 2.5 and "eval_loss" not in records[0]



def test_a_resumed_metrics_file_holds_one_timeline(tmp_path):
    """Resumed at step 4 of a run that logged 1-6 and was cut inside line 7: steps 1-4, then the resumed 5 and 6."""
    path = tmp_path / "m.jsonl"
    m = MetricsFile(str(path), 0, resumed_at=None)
    for s in range(1, 7):
        m.write(_report(step=s, loss=9.0))
    m.close()
    with open(path, "a") as f:
        f.write('{"step": 7, "lo')
    m = MetricsFile(str(path), 0, resumed_at=4)
    for s in (5, 6):
        m.write(_report(step=s, loss=1.0))
    m.close()
    records = read_metrics(path)
    assert [(r["step"], r["loss"]) for r in records] == [(1, 9.0), (2, 9.0), (3, 9.0), (4, 9.0), (5, 1.0), (6, 1.0)]
    MetricsFile(str(tmp_path / "new.jsonl"), 0, resumed_at=4).close()  # resumed, but no file yet: made
    assert read_metrics(tmp_path / "new.jsonl") == []

def test_the_chatter_filter_keeps_everything_else(monkeypatch):
    out = io.StringIO()
    f = LineFilter(out)
    f.write("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully\nkeep me\n[2026-12-02 15:47:")
    f.write("21,641] [INFO] [launch.py:152:main] WORLD INFO DICT\nSEED_LAYERS=False BASE_SEED=1234 SEED_FN=None\n")
    f.write("stage=0 layers=3\n     0: Embedding\n  loss: TokenLoss\nUsing topology: {ProcessCoord(pipe=0): 0}\n")
    f.write("[2026-12-02 15:47:21,641] [ERROR] [x.py:1:f] bad\n")
    f.write("partial")
    assert out.getvalue() == "keep me\n[2026-12-02 15:47:21,641] [ERROR] [x.py:1:f] bad\n"
    f.write(" line\n")
    assert out.getvalue().endswith("partial line\n")
    logger = logging.getLogger("DeepSpeed")
    monkeypatch.setattr(logger, "filters", list(logger.filters))
    monkeypatch.setattr("sys.stdout", io.StringIO())
    quiet_engines()
    assert not logger.filter(logging.LogRecord("DeepSpeed", logging.WARNING, "", 0, "w", None, None))
    assert logger.filter(logging.LogRecord("DeepSpeed", logging.ERROR, "", 0, "e", None, None))
    import sys

    assert isinstance(sys.stdout, LineFilter)


def test_tensorboard_scalars_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from plugin.monitor.tensorboard import TensorBoard

    board = TensorBoard(str(tmp_path), load_recipe("cpu_single"), {"backend": "native", "data": 1})
    board.write(_report(step=1))
    board.write(_report(step=2, mfu=0.25), eval_loss=2.5)
    board.close()
    events = EventAccumulator(str(tmp_path)).Reload()
    assert [e.value for e in events.Scalars("train/loss")] == [3.25, 3.25]
    assert [e.step for e in events.Scalars("perf/mfu")] == [2] and [e.step for e in events.Scalars("eval/loss")] == [2]
    assert {"recipe/text_summary", "layout/text_summary"} <= set(events.Tags()["tensors"])


def test_a_resumed_tensorboard_holds_one_timeline(tmp_path):
    """A run resumed from step 4 of one that logged 1-8 into the same DIR: TensorBoard shows 1-4, then the resumed
    5-6 (without purge_step it showed 1-8 and then 5-6 again, the line drawn back from 8 to 5)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from plugin.monitor.tensorboard import TensorBoard

    recipe = load_recipe("cpu_single")
    first = TensorBoard(str(tmp_path), recipe, {"backend": "native"})
    for step in range(1, 9):
        first.write(_report(step=step), eval_loss=1.0 if step % 4 == 0 else None)
    first.close()
    time.sleep(1.1)  # event files are named by the second, then pid and a counter: the resumed run's must sort after
    resumed = TensorBoard(str(tmp_path), recipe, {"backend": "native"}, resumed_at=4)
    for step in (5, 6):
        resumed.write(_report(step=step, loss=2.0))
    resumed.close()
    events = EventAccumulator(str(tmp_path)).Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == \
        [(1, 3.25), (2, 3.25), (3, 3.25), (4, 3.25), (5, 2.0), (6, 2.0)]
    assert [e.step for e in events.Scalars("eval/loss")] == [4]


def test_tensorboard_missing_is_one_line(monkeypatch, capsys):
    import importlib.util

    import train
    from plugin.monitor import tensorboard

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    assert tensorboard.missing() == ("--tensorboard needs the tensorboard package -> pip install "
                                     "'parallel-recipe[monitor]' (tensorboard and matplotlib)")
    assert train.main(["--recipe", "cpu_single", "--tensorboard", "tb"]) == 2
    assert capsys.readouterr().err.strip() == tensorboard.missing()


def test_plot_draws_runs_overlaid(tmp_path, capsys, monkeypatch):
    """The picture ``plot`` saves holds each run's loss, eval loss and lr lines, with the files' values (a PNG alone
    would pass with the lr or the eval line missing): the figure it saves is read back, the real drawing code run."""
    pytest.importorskip("matplotlib")
    from plugin.cli.main import main
    from plugin.monitor import plot

    lrs = [1e-3 * min(1, s / 2) for s in range(1, 6)]
    losses = {}
    for name, scale in (("single", 1.0), ("tp2", 1.001)):
        losses[name] = [4 - s * scale / 4 for s in range(1, 6)]
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for s in range(1, 6):
                record = {**_report(step=s, loss=losses[name][s - 1], lr=lrs[s - 1]).to_json(),
                          **({"eval_loss": 3.5 - (name == "tp2") * 0.25} if s in (3, 5) else {})}
                f.write(json.dumps(record) + "\n")
    figures = []
    draw = plot.draw_runs
    monkeypatch.setattr(plot, "draw_runs", lambda *a, **k: figures.append(draw(*a, **k)) or figures[-1])
    out = tmp_path / "plot.png"
    assert main(["plot", str(tmp_path / "single.jsonl"), str(tmp_path / "tp2.jsonl"), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    top, bottom = figures[0].axes

    def lines(axes):
        return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in axes.get_lines()}

    assert lines(top) == {"single: loss": ([1, 2, 3, 4, 5], losses["single"]),
                          "single: eval loss": ([3, 5], [3.5, 3.5]),
                          "tp2: loss": ([1, 2, 3, 4, 5], losses["tp2"]), "tp2: eval loss": ([3, 5], [3.25, 3.25])}
    assert lines(bottom) == {"single": ([1, 2, 3, 4, 5], lrs), "tp2": ([1, 2, 3, 4, 5], lrs)}
    assert [t.get_text() for t in top.get_legend().get_texts()] == list(lines(top))
    assert (top.get_ylabel(), bottom.get_ylabel(), bottom.get_xlabel()) == ("loss", "learning rate", "step")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert main(["plot", str(tmp_path / "bad.jsonl"), "-o", str(out)]) == 2
    assert "bad.jsonl: line 1: not a JSON line" in capsys.readouterr().err


def _cells(svg: str) -> list:
    root = ET.fromstring(svg)
    return [r for r in root.iter("{http://www.w3.org/2000/svg}rect") if r.find("{http://www.w3.org/2000/svg}title")
            is not None]


def test_rank_map_svg_has_a_cell_per_rank_and_panel(tmp_path):
    from plugin.cli.main import main

    svg_path = tmp_path / "map.svg"
    assert main(["show", "tp2_pp2_dp2", "--svg", str(svg_path)]) == 0
    svg = svg_path.read_text()
    cells = _cells(svg)
    assert len(cells) == 3 * 8  # panels tensor, data, pipeline x 8 ranks
    tips = [c.find("{http://www.w3.org/2000/svg}title").text for c in cells]
    assert "rank 5: pipeline 1, data 0, tensor 1" in tips
    assert svg.count('stroke="#222"') == 4  # four tensor groups, each inside its node


SVG = "{http://www.w3.org/2000/svg}"


def _outlines(svg: str) -> dict[str, list[tuple[float, float, float, float]]]:
    """Each group outline's title and the (left, top, right, bottom) box of each of its loops."""
    out = {}
    for path in ET.fromstring(svg).iter(f"{SVG}path"):
        loops = []
        for loop in path.get("d").split("M")[1:]:
            points = [tuple(map(float, p.split(","))) for p in re.findall(r"[-\d.]+,[-\d.]+", loop)]
            xs, ys = [x for x, _ in points], [y for _, y in points]
            loops.append((min(xs), min(ys), max(xs), max(ys)))
        out[path.find(f"{SVG}title").text] = loops
    return out


def _inside(cells: list, boxes: list) -> list[int]:
    """The ranks (cell titles "rank N: ...") whose cell centre lies in one of ``boxes``."""
    out = []
    for c in cells:
        x, y, w = float(c.get("x")), float(c.get("y")), float(c.get("width"))
        if any(left < x + w / 2 < right and top < y + w / 2 < bottom for left, top, right, bottom in boxes):
            out.append(int(c.find(f"{SVG}title").text.split()[1].rstrip(":")))
    return out


@pytest.mark.parametrize("topology, per_node, loops", [
    (Topology(dp_size=2, tp_size=8), 4, {0: 1, 1: 1}),  # each group two whole nodes: one box over two rows
    (Topology(dp_size=2, tp_size=6, pp_size=2), 8, {0: 1, 1: 2, 2: 2, 3: 1}),  # groups 1 and 2 wrap to the next node
])
def test_a_tensor_group_across_nodes_is_one_outline(topology, per_node, loops):
    """One outline per group, around exactly its ranks, whatever nodes it covers (it was drawn as one box per node,
    so that tensor 8 over nodes of 4 looked like tensor 4); red and dashed where it crosses nodes."""
    svg = rank_map_svg(topology, gpus_per_node=per_node)
    outlines = _outlines(svg)
    tensor = topology.tp_size
    assert len(outlines) == topology.world_size // tensor
    cells = _cells(svg)[:topology.world_size]  # the tensor panel's
    paths = list(ET.fromstring(svg).iter(f"{SVG}path"))
    for g in range(topology.world_size // tensor):
        ranks = list(range(g * tensor, (g + 1) * tensor))
        nodes = sorted({r // per_node for r in ranks})
        where = f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {nodes[0]}-{nodes[-1]}"
        title = f"tensor group {g}: ranks {ranks[0]}-{ranks[-1]} ({where})"
        assert len(outlines[title]) == loops[g] and _inside(cells, outlines[title]) == ranks
        crossing = len(nodes) > 1
        assert (paths[g].get("stroke"), paths[g].get("stroke-dasharray")) == \
            (("#d62728", "5,3") if crossing else ("#222", None))


def test_rank_map_aggregates_above_1024_ranks():
    svg = rank_map_svg(Topology(pp_size=8, dp_size=64, tp_size=8), gpus_per_node=8)
    cells = _cells(svg)
    assert len(cells) == 3 * 512 and "each cell is 1 node(s), 8 ranks" in svg  # 4096 ranks, a cell per node
    assert any("ranks 0-7: tensor 0-7" == c.find("{http://www.w3.org/2000/svg}title").text for c in cells)


class Coord4(NamedTuple):
    pp: int
    dp: int
    tp: int
    cp: int = 0


class FourAxes:
    """A topology with a context axis between tensor and data (Megatron's order), as a later Topology will have."""

    pp_size, dp_size, tp_size, cp_size = 2, 2, 2, 2
    world_size = 16

    def coord(self, rank):
        return Coord4(pp=rank // 8, dp=rank // 4 % 2, tp=rank % 2, cp=rank // 2 % 2)


def test_rank_map_takes_any_further_axis():
    axes = axes_of(FourAxes())
    assert [(a.name, a.stride) for a in axes] == [("tensor", 1), ("context", 2), ("data", 4), ("pipeline", 8)]
    svg = rank_map_svg(FourAxes(), gpus_per_node=8)
    assert ">context 2</text>" in svg and len(_cells(svg)) == 4 * 16
    assert "rank 6: pipeline 0, data 1, context 1, tensor 0" in svg


def _text_extents(svg: str) -> list[tuple[str, float, float]]:
    """(text, x, estimated right end) of every SVG text left-anchored (DejaVu Sans: ~0.6 em a character, bold 0.65)."""
    out = []
    for t in ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}text"):
        if t.get("text-anchor") == "middle":
            continue
        em = float(t.get("font-size")) * (0.65 if t.get("font-weight") == "bold" else 0.6)
        out.append((t.text, float(t.get("x")), float(t.get("x")) + em * len(t.text)))
    return out


@pytest.mark.parametrize("topology, per_node", [
    (Topology(pp_size=4, dp_size=128, tp_size=4), 8),  # 2048 ranks, aggregated: 128 data replicas in the legend
    (Topology(pp_size=2, dp_size=32, tp_size=8), 8),
    (Topology(pp_size=1, dp_size=16, tp_size=2), None),  # no cluster block: the header says 8 per node assumed
])
def test_rank_map_text_stays_inside_the_picture_and_apart(topology, per_node):
    svg = rank_map_svg(topology, gpus_per_node=per_node, title="rank map of a long recipe name")
    width = float(ET.fromstring(svg).get("width"))
    extents = _text_extents(svg)
    assert [t for t, _, right in extents if right > width] == []
    titles = [(t, right) for t, _, right in extents if re.fullmatch(r"(tensor|data|pipeline) \d+", t)]
    notes = [x for t, x, _ in extents if t.startswith("colour: ")]
    assert len(titles) == len(notes) == sum(s > 1 for s in (topology.tp_size, topology.dp_size, topology.pp_size))
    assert all(x > right for (_, right), x in zip(titles, notes, strict=True)), (titles, notes)


@pytest.mark.parametrize("topology, header", [
    (Topology(pp_size=2, dp_size=2, tp_size=2), "pipeline 2 x data 2 x tensor 2 = 8 ranks on 1 node x 8 GPUs"),
    (Topology(pp_size=2, tp_size=2), "pipeline 2 x tensor 2 (data 1) = 4 ranks on 1 node x 4 GPUs"),
    (Topology(), "pipeline 1 x data 1 x tensor 1 = 1 rank on 1 node x 1 GPU"),
])
def test_rank_map_header_names_the_layout_slowest_first(topology, header):
    """An axis of size 1 has no place in the rank order: it follows in brackets (it once led: "data 1 x pipeline 2 x
    tensor 2", against the panels' and the rank order's tensor-first nesting)."""
    svg = rank_map_svg(topology, gpus_per_node=8)
    assert header in [t for t, _, _ in _text_extents(svg)]


def _hue(fill: str) -> float:
    import colorsys

    r, g, b = (int(fill[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return colorsys.rgb_to_hls(r, g, b)[0] * 360


@pytest.mark.parametrize("topology", [Topology(pp_size=2, dp_size=2, tp_size=2), FourAxes(),
                                      Topology(pp_size=2, dp_size=16, tp_size=4)])
def test_each_panel_has_its_own_colour_family(topology):
    """Every panel's cells and legend are shades of one hue, and no two panels' hues come near each other (one palette
    for all once made tensor rank 0, data replica 0 and pipeline stage 0 the same blue)."""
    svg = rank_map_svg(topology, gpus_per_node=8)
    cells = _cells(svg)
    world = topology.world_size
    panels = [[c.get("fill") for c in cells[k:k + world]] for k in range(0, len(cells), world)]
    assert len(panels) == sum(a.size > 1 for a in axes_of(topology))
    legends = [r.get("fill") for r in ET.fromstring(svg).iter(f"{SVG}rect")
               if r.get("width") == "12" and r.get("fill", "").startswith("#")]
    assert set(legends) == {f for panel in panels for f in panel}  # the key shows the cells' colours
    hues = [[_hue(f) for f in set(panel)] for panel in panels]
    for k, mine in enumerate(hues):
        assert max(mine) - min(mine) <= 36, (k, mine)  # one family (no family wraps around 0 degrees)
        for other in hues[k + 1:]:
            gap = min(min(abs(a - b), 360 - abs(a - b)) for a in mine for b in other)
            assert gap >= 5, (k, mine, other)
