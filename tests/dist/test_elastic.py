"""Elastic runs (issue 24): two localhost "nodes" (``launch.sh --elastic 1:3 --master 127.0.0.1:PORT --nproc 2``, two
torchrun agents with a c10d rendezvous) train a tensor-2, data-auto recipe at data 2; one node is lost at a seeded
step (its agent and every worker SIGKILLed at once, as a machine dies: torchrun starts each worker in a session of
its own, so killing the agent alone would leave them training); the survivor goes on alone at data 1 from the last
complete checkpoint; a third node joins and the job goes back to data 2 and finishes. Every step any start logged
must equal one plain python process's loss at that step (rel 1e-4), the steps redone after a restart included.

The third node is started while the survivor's workers are held (SIGSTOP) after their first step alone and let go
once the survivor's agent has seen it waiting (and stops them for the new round): the survivor cannot finish the
run in the seconds a new agent takes to start, whatever the machine's load. One case per back end, as the
multinode tests do, both in .ci/run's slow step: the native back end (``"launcher": "torchrun"``) and DeepSpeed's
engine under torchrun. ``ELASTIC_KILL_SEED`` draws the step of the loss (printed).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .ports import free_port
from .runs import ROOT, cpu_env, recipe_variant, train

pytestmark = [pytest.mark.dist, pytest.mark.native]

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
STEPS, RTOL, SAVE_EVERY = 10, 1e-4, 3  # saves at steps 3, 6, 9, 10: each restart redoes the steps since the last
SEED = int(os.environ.get("ELASTIC_KILL_SEED", "24"))
BLOCKS = {  # SGD with momentum, clipping below the gradient norm, a schedule: a gradient or lr bug shows in the loss
    "parallelism": {"data": "auto", "tensor": 2, "pipeline": 1}, "batch": {"global": 16, "micro": 4},
    "optimizer": {"name": "sgd", "lr": 0.3, "momentum": 0.9}, "gradient_clipping": 0.5,
    "lr_schedule": {"warmup_steps": 3, "decay": "cosine", "decay_steps": 10, "min_lr": 0.03}}
SHAPE = re.compile(r": start: (\w+) on cpu, gloo, (data \d+) x tensor 2 x pipeline 1,")
RESUMED = re.compile(r"^resumed at step (\d+) after ([\d.]+) s, data (\d+) -> (\d+)", re.M)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same model and batches on one plain python process (tensor 1: data auto resolves to 1)."""
    tmp = tmp_path_factory.mktemp("reference")
    recipe = recipe_variant("cpu_single", tmp, "elastic_single", **{**BLOCKS, "parallelism": {"data": "auto"}})
    run = train(recipe, 1, tmp, launcher="python", steps=STEPS)
    assert sorted(run.losses) == list(range(1, STEPS + 1)), run.log()
    return run.losses


def _tree(pid: int) -> list[int]:
    """``pid`` and every process under it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            pass
    return out


def _signal(pids, sig) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def _records(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line a kill cut short
            pass
    return out


class Node:
    """One launch.sh --elastic, its output in files (a pipe left unread would block the agent)."""

    def __init__(self, name: str, recipe: Path, tmp: Path, master: str, metrics: Path):
        self.name, self.err_path = name, tmp / f"{name}.err"
        cmd = ["bash", str(ROOT / "launch.sh"), "--elastic", "1:3", "--master", master, "--nproc", "2", str(recipe),
               "--", "--steps", str(STEPS), "--save", str(tmp / "ckpt"), "--save-every", str(SAVE_EVERY), "--metrics",
               str(metrics), "--log-every", "1"]
        env = cpu_env(PYTHON=sys.executable, LOGLEVEL="INFO")  # the agents' INFO lines: when one sees a newcomer
        self.proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=open(tmp / f"{name}.out", "w"),
                                     stderr=open(self.err_path, "w"), start_new_session=True)

    @property
    def err(self) -> str:
        return self.err_path.read_text()

    def workers(self) -> list[int]:
        """The train.py processes under this node's launch.sh: not launch.sh's supervisor nor torchrun's agent, which
        must keep running (a stopped agent would never see a newcomer)."""
        def cmdline(pid: int) -> str:
            try:
                return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                return ""

        return [p for p in _tree(self.proc.pid)[1:]
                if "train.py" in cmdline(p) and "torch.distributed.run" not in cmdline(p)]

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _signal(_tree(self.proc.pid), signal.SIGKILL)
            return self.proc.wait()


def _listening(master: str) -> bool:
    """Whether the rendezvous store at ``master`` takes connections: the first agent to arrive hosts it."""
    host, port = master.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


def _wait(what: str, ready, nodes, limit: float = 300) -> None:
    start = time.monotonic()
    while not ready():
        if time.monotonic() - start > limit or any(n.proc.poll() is not None for n in nodes):
            logs = "\n".join(f"--- {n.name} (exit {n.proc.poll()})\n{n.err[-5000:]}" for n in nodes)
            raise AssertionError(f"waiting for {what}\n{logs}")
        time.sleep(0.05)


CASES = {"native": "torchrun", "deepspeed": "auto"}  # back end -> the recipe's launcher field


# both in .ci/run's slow step (minutes each: three agents, a loss and a join); the native case forced by its recipe
@pytest.mark.slow
@pytest.mark.parametrize("backend", list(CASES))
def test_lose_a_node_then_gain_one_with_one_process_losses(backend, reference, tmp_path):
    if backend == "deepspeed" and not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    kill_at = random.Random(SEED).randint(2, 4)
    print(f"ELASTIC_KILL_SEED={SEED}: node B is lost after step {kill_at}")
    recipe = recipe_variant("cpu_tp2_dp2", tmp_path, f"elastic_{backend}", **BLOCKS, launcher=CASES[backend])
    metrics, master = tmp_path / "metrics.jsonl", f"127.0.0.1:{free_port()}"
    a = Node("A", recipe, tmp_path, master, metrics)
    _wait("A's agent hosting the rendezvous store", lambda: _listening(master), [a])  # B's loss cannot take it
    b = Node("B", recipe, tmp_path, master, metrics)
    nodes = [a, b]
    c = None
    try:
        _wait(f"step {kill_at} at data 2", lambda: any(r["step"] >= kill_at for r in _records(metrics)), nodes)
        lost = max(r["restart"] for r in _records(metrics))
        _signal(_tree(b.proc.pid), signal.SIGKILL)  # the node is gone: its agent and its workers at once
        assert b.proc.wait(timeout=30) != 0
        nodes = [a]
        _wait("a step of A alone", lambda: any(r["restart"] > lost for r in _records(metrics)), nodes)
        held = a.workers()
        _signal(held, signal.SIGSTOP)  # A cannot finish before C's agent has started
        c = Node("C", recipe, tmp_path, master, metrics)
        nodes = [a, c]
        _wait("A's agent seeing C", lambda: "Detected 1 new nodes" in a.err, nodes, limit=120)
        joined = time.monotonic()
        alone = max(r["restart"] for r in _records(metrics))
        _signal(held, signal.SIGCONT)
        scale_up_s = None  # C's join -> the first step trained with it
        while scale_up_s is None and time.monotonic() - joined < 300:
            if any(r["restart"] > alone for r in _records(metrics)):
                scale_up_s = time.monotonic() - joined
            elif a.proc.poll() is not None and c.proc.poll() is not None:
                break
            time.sleep(0.05)
        codes = {n.name: n.finish(timeout=300) for n in (a, c)}
    finally:
        for n in (a, b, c):
            if n is not None and n.proc.poll() is None:
                _signal(_tree(n.proc.pid), signal.SIGKILL)
    logs = "\n".join(f"--- {n.name} (exit {n.proc.returncode})\n{n.err[-6000:]}" for n in (a, b, c))
    assert codes == {"A": 0, "C": 0}, logs

    out = a.err + c.err
    shapes = [m.groups() for m in SHAPE.finditer(out)]  # rank 0's start line at each start, wherever rank 0 was
    assert {s[0] for s in shapes} == {backend}, (shapes, logs)
    assert [s[1] for s in shapes][-3:] == ["data 2", "data 1", "data 2"], (shapes, logs)
    resumed = [(int(n), float(s), int(d0), int(d1)) for n, s, d0, d1 in RESUMED.findall(out)]
    assert [(d0, d1) for *_, d0, d1 in resumed][-2:] == [(2, 1), (1, 2)], (resumed, logs)
    records = _records(metrics)
    # one timeline (a resumed run drops the lines past its checkpoint): each step once, tagged with the start that
    # trained it last; the redone steps are the later start's, so their losses are the ones compared
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), (records, logs)
    starts = [r["restart"] for r in records]
    assert starts == sorted(starts) and starts[-1] >= 2, (records, logs)
    for r in records:
        assert math.isclose(r["loss"], reference[r["step"]], rel_tol=RTOL), \
            f"step {r['step']} (start {r['restart']}): loss {r['loss']!r} != one process {reference[r['step']]!r}"
    print(f"{backend}: starts {[s[1] for s in shapes]}; resumed {resumed}; scale-up: C's "
          f"join -> a step at data 2 in {scale_up_s} s")
    _print_losses(records, reference)


def _print_losses(records: list[dict], reference: dict) -> None:
    """Each logged step against one process (what docs/elastic.md's table shows)."""
    print("step  start  loss        one process  rel. difference")
    for r in records:
        one = reference[r["step"]]
        print(f"{r['step']:>4}  {r['restart']:>5}  {r['loss']:.8f}  {one:.8f}   {abs(r['loss'] - one) / abs(one):.1e}")


@pytest.mark.slow
def test_a_node_that_trains_none_stands_by_and_is_back_at_the_next_restart(reference, tmp_path):
    """Three nodes of 2 where 4 processes train (data 3 does not split the global batch 16 / micro 4): the node
    holding ranks 4-5 trains none. torch's agent would leave the job once its workers all exit 0 (SUCCEEDED, its
    exit barrier; then out of every restart, and closing the rendezvous at 300 s: plugin/elastic/standby.py), so its
    first process stands by. A trainer other than A (which hosts the rendezvous store) is lost: the next start must
    be data 2 on A and the node that stood by (data 1 if it had left), and every process ends with the job."""
    kill_at = random.Random(SEED).randint(2, 4)
    recipe = recipe_variant("cpu_tp2_dp2", tmp_path, "elastic_standby", **BLOCKS, launcher="torchrun")
    metrics, master = tmp_path / "metrics.jsonl", f"127.0.0.1:{free_port()}"
    a = Node("A", recipe, tmp_path, master, metrics)
    nodes = [a]
    try:
        _wait("A's agent hosting the rendezvous store", lambda: _listening(master), nodes)
        nodes += [Node("B", recipe, tmp_path, master, metrics), Node("C", recipe, tmp_path, master, metrics)]
        # the three may meet in the first round or in a later one (a membership change): the 3-node start is the one
        # whose sit-out line names a node standing by, and its records carry a later start number than any before it
        _wait("a node standing by", lambda: any("stands by, its node trains none" in n.err for n in nodes), nodes)
        idle = next(n for n in nodes if "stands by, its node trains none" in n.err)
        before = max((r["restart"] for r in _records(metrics)), default=-1)
        _wait(f"step {kill_at} of the 3-node start",
              lambda: any(r["restart"] > before and r["step"] >= kill_at for r in _records(metrics)), nodes)
        lost = next(n for n in nodes if n not in (a, idle))
        three = max(r["restart"] for r in _records(metrics))
        _signal(_tree(lost.proc.pid), signal.SIGKILL)
        assert lost.proc.wait(timeout=30) != 0
        survivors = [n for n in nodes if n is not lost]
        _wait("a step after the loss", lambda: any(r["restart"] > three for r in _records(metrics)), survivors)
        codes = {n.name: n.finish(timeout=300) for n in survivors}
    finally:
        for n in nodes:
            if n.proc.poll() is None:
                _signal(_tree(n.proc.pid), signal.SIGKILL)
    logs = "\n".join(f"--- {n.name} (exit {n.proc.returncode})\n{n.err[-6000:]}" for n in nodes)
    assert codes == {n.name: 0 for n in survivors}, logs
    out = "".join(n.err for n in survivors)
    assert idle.err.count("stands by, its node trains none") == 1, logs  # it trained at the next start
    shapes = [m.groups() for m in SHAPE.finditer(out)]
    assert [s[1] for s in shapes][-2:] == ["data 2", "data 2"], (shapes, logs)  # the node that stood by came back
    resumed = [(int(n), float(s), int(d0), int(d1)) for n, s, d0, d1 in RESUMED.findall(out)]
    assert [(d0, d1) for *_, d0, d1 in resumed][-1:] == [(2, 2)], (resumed, logs)
    records = _records(metrics)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), (records, logs)
    assert records[-1]["restart"] > three, (records, logs)
    for r in records:
        assert math.isclose(r["loss"], reference[r["step"]], rel_tol=RTOL), \
            f"step {r['step']} (start {r['restart']}): loss {r['loss']!r} != one process {reference[r['step']]!r}"
    print(f"stand-by: {idle.name} stood by, {lost.name} lost after step {kill_at}; starts {[s[1] for s in shapes]}; "
          f"resumed {resumed}")
    _print_losses(records, reference)
