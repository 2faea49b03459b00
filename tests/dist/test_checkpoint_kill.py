"""Crash-safe saving (issue 13): a 2-rank torchrun run of train.py saving every 2 steps (``--keep 2``) is killed
with SIGKILL, once when a rank is inside a save (``step-00000004.partial`` exists) and once when a save has just
been committed (``step-00000006`` exists); each time the job ends, ``--resume`` takes the last complete save and
the steps after it equal the uninterrupted run's, bit for bit (same layout)."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .runs import ROOT, cpu_env, launcher_argv, recipe_variant, train

pytestmark = [pytest.mark.dist, pytest.mark.native]
STEPS = 10


def _ranks(pid: int) -> dict[int, int]:
    """{RANK: pid} of the processes under ``pid`` that torchrun started."""
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


def _kill_when(recipe, tmp: Path, ckpt: Path, appears: str, rank: int) -> tuple[int, float]:
    cmd = launcher_argv("torchrun", 2) + [str(ROOT / "train.py"), "--recipe", str(recipe), "--steps", str(STEPS),
                                          "--save", str(ckpt), "--save-every", "2", "--keep", "2"]
    proc = subprocess.Popen(cmd, cwd=tmp, env=cpu_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    start = time.monotonic()
    try:
        while not (ckpt / appears).exists():
            assert proc.poll() is None and time.monotonic() - start < 120, f"{appears} never appeared"
            time.sleep(0.005)
        os.kill(_ranks(proc.pid)[rank], signal.SIGKILL)
        killed = time.monotonic()
        code = proc.wait(timeout=60)  # a hang would fail here
        return code, time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("appears,rank", [("step-00000004.partial", 1), ("step-00000006", 0)])
def test_kill_then_resume_continues_the_uninterrupted_run(appears, rank, tmp_path):
    recipe = recipe_variant("cpu_dp4", tmp_path, "dp2", parallelism={"data": 2, "tensor": 1, "pipeline": 1},
                            batch={"global": 16, "micro": 8}, launcher="torchrun")
    whole = train(recipe, 2, tmp_path, launcher="torchrun", steps=STEPS)
    ckpt = tmp_path / "ckpt"
    code, seconds = _kill_when(recipe, tmp_path, ckpt, appears, rank)
    print(f"killed rank {rank} when {appears} appeared: exit {code} after {seconds:.1f} s")
    assert code != 0
    complete = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-") and not p.name.endswith(".partial"))
    resumed = train(recipe, 2, tmp_path, launcher="torchrun", steps=STEPS, extra=["--resume", ckpt])
    first = min(resumed.losses)
    print(f"complete steps after the kill: {complete}; resumed from step {first - 1}")
    assert first - 1 == max(int(n.split("-")[1].split(".")[0]) for n in complete if (ckpt / n / ".metadata").exists())
    assert {s: resumed.losses[s] for s in range(first, STEPS + 1)} == {s: whole.losses[s] for s in
                                                                       range(first, STEPS + 1)}
