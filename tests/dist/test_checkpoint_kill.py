"""Crash-safe saving (issue 13): 2-rank runs of train.py saving every 2 steps (``--keep 2``) are killed with
SIGKILL at seeded random moments, one of them inside a save, and resumed with ``--resume`` until one finishes.

Each kill: a random rank, at a random moment drawn from a seeded generator (``CKPT_KILL_SEED``, printed): either
inside a save (when a random save's ``step-N.partial`` appears, plus a random 0-20 ms) or anywhere in the run
(when a random complete save appears, plus a random 0-1.5 s: in training, in the next save or between). Every time
the job must end (no hang), ``--resume`` must take the last complete save, and every step any segment logged must
equal the uninterrupted run's: bit for bit on the same back end (torchrun, native: two kills), and, for DeepSpeed
(one kill, ZeRO-1), the steps it logged twice bit for bit and every step within 1e-5 of the uninterrupted native run
(the parity suites' figure between the back ends). Six launches in all."""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from plugin.engines.choose import importable

from .runs import ROOT, cpu_env, launcher_argv, recipe_variant, release_deepspeed_shm, train

pytestmark = [pytest.mark.dist, pytest.mark.native]
STEPS = 10
SEED = int(os.environ.get("CKPT_KILL_SEED", "13"))


def _ranks(pid: int) -> dict[int, int]:
    """{RANK: pid} of the processes under ``pid`` that the launcher started."""
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
            env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        todo += [int(c) for c in children]
        for kv in env:
            if kv.startswith(b"RANK=") and p != pid:
                out[int(kv[5:])] = p
    return out


def _complete(ckpt: Path) -> list[int]:
    if not ckpt.exists():
        return []
    return sorted(int(p.name[5:]) for p in ckpt.iterdir()
                  if re.fullmatch(r"step-\d{8}", p.name) and (p / ".metadata").exists())


def _losses(metrics: Path) -> dict[int, float]:
    import json

    if not metrics.exists():
        return {}
    out = {}
    for line in metrics.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:  # the last line, cut by the kill
            continue
        out[r["step"]] = r["loss"]
    return out


def _segment(recipe, launcher: str, tmp: Path, ckpt: Path, i: int, draw) -> tuple[dict, str]:
    """One launch of train.py (resuming when a complete save exists); ``draw(resumed_from)``: the kill moment
    (anchor, delay, rank), or ``draw`` None: run to the end."""
    metrics = tmp / f"segment-{launcher}-{i}.jsonl"
    argv = launcher_argv(launcher, 2)
    cmd = argv + [str(ROOT / "train.py"), "--recipe", str(recipe), "--steps", str(STEPS), "--save", str(ckpt),
                  "--save-every", "2", "--keep", "2", "--metrics", str(metrics)]
    resumed_from = max(_complete(ckpt), default=0)
    if resumed_from:
        cmd += ["--resume", str(ckpt)]
    kill = draw(resumed_from) if draw else None
    log = tmp / f"segment-{launcher}-{i}.log"  # a file, not a pipe: a full pipe would block the job
    proc = subprocess.Popen(cmd, cwd=tmp, env=cpu_env(), stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    start, what = time.monotonic(), "ran to the end"
    try:
        if kill is not None:
            anchor, delay, rank = kill
            while not (ckpt / anchor).exists():
                assert proc.poll() is None, f"{anchor} never appeared: {log.read_text()[-3000:]}"
                assert time.monotonic() - start < 420, f"{anchor} never appeared: {log.read_text()[-3000:]}"
                time.sleep(0.002)
            time.sleep(delay)
            inside = sorted(p.name for p in ckpt.iterdir() if p.name.endswith(".partial"))
            ranks = _ranks(proc.pid)
            assert rank in ranks and proc.poll() is None, f"the run ended before the kill moment ({kill}): draw earlier"
            os.kill(ranks[rank], signal.SIGKILL)
            killed = time.monotonic()
            code = proc.wait(timeout=60)  # a hang would fail here
            assert code != 0
            what = (f"killed rank {rank} {delay * 1000:.0f} ms after {anchor} appeared "
                    f"({'inside the save of ' + inside[0] if inside else 'outside any save'}): exit {code} after "
                    f"{time.monotonic() - killed:.1f} s")
        else:
            code = proc.wait(timeout=300)
            assert code == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        if launcher == "deepspeed":
            release_deepspeed_shm(argv[argv.index("--master_port") + 1])
    losses = _losses(metrics)
    if resumed_from:
        assert min(losses, default=resumed_from + 1) == resumed_from + 1, (resumed_from, sorted(losses))
    return losses, f"segment {i} (from step {resumed_from}): {what}; complete saves now {_complete(ckpt)}"


def _draw(rng: random.Random, inside: bool):
    """A kill moment after the segment's resume point r: inside the save of a random later step before the last
    (0-20 ms after its ``.partial`` appears: a save of this model can complete within those 20 ms, and one of the
    last step then leaves the resumed run no step to compare), or anywhere (0-300 ms after a random later save
    completed, at most step 6 so that the run is still going: 4 steps and 2 saves of this model take about 0.35 s
    here)."""
    def at(r: int):
        if inside:
            step = rng.choice(range(r + 2, max(r + 4, STEPS), 2))
            return f"step-{step:08d}.partial", rng.uniform(0, 0.02), rng.randrange(2)
        return f"step-{rng.choice(range(r + 2, max(r + 2, 6) + 1, 2)):08d}", rng.uniform(0, 0.3), rng.randrange(2)
    return at


def _run_until_done(recipe, launcher, tmp, kills) -> tuple[list[dict], list[str]]:
    ckpt = tmp / f"ckpt-{launcher}"
    segments, log = [], []
    for i, kill in enumerate([*kills, None]):
        losses, line = _segment(recipe, launcher, tmp, ckpt, i, kill)
        segments.append(losses)
        log.append(line)
        print(line)
    assert max(segments[-1]) == STEPS
    return segments, log


def _recipe(tmp, launcher):
    return recipe_variant("cpu_dp4", tmp, f"dp2_{launcher}", parallelism={"data": 2, "tensor": 1, "pipeline": 1},
                          batch={"global": 16, "micro": 8}, launcher=launcher)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted native run (torchrun)."""
    tmp = tmp_path_factory.mktemp("whole")
    return train(_recipe(tmp, "torchrun"), 2, tmp, launcher="torchrun", steps=STEPS).losses


def test_killed_at_random_moments_then_resumed_continues_the_uninterrupted_run(whole, tmp_path):
    rng = random.Random(SEED)
    print(f"CKPT_KILL_SEED={SEED}")
    segments, _ = _run_until_done(_recipe(tmp_path, "torchrun"), "torchrun", tmp_path,
                                  [_draw(rng, inside=True), _draw(rng, inside=False)])
    for i, losses in enumerate(segments):
        assert losses == {s: whole[s] for s in losses}, f"segment {i}"


@pytest.mark.deepspeed
@pytest.mark.slow
@pytest.mark.skipif(not importable("deepspeed"), reason="deepspeed not installed")
def test_deepspeed_killed_at_a_random_moment_then_resumed(whole, tmp_path):
    rng = random.Random(SEED + 1)
    print(f"CKPT_KILL_SEED={SEED} (+1 for DeepSpeed)")
    segments, _ = _run_until_done(_recipe(tmp_path, "deepspeed"), "deepspeed", tmp_path,
                                  [_draw(rng, inside=rng.random() < 0.5)])
    twice = set(segments[0]) & set(segments[1])
    assert all(segments[0][s] == segments[1][s] for s in twice), "the redone steps differ from the killed run's"
    for i, losses in enumerate(segments):
        rel = max(abs(loss - whole[s]) / abs(whole[s]) for s, loss in losses.items())
        print(f"DeepSpeed segment {i}: steps {min(losses)}-{max(losses)}, rel {rel:.2e} to the native run")
        assert rel < 1e-5, f"segment {i}"
