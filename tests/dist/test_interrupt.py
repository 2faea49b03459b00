"""Ctrl-C and preemption on real launchers (issue 21): 2 processes, data parallel, saving every 3 steps.

* SIGINT to ``launch.sh`` once a save is complete, one launch per launcher (deepspeed, torchrun, accelerate): it
  ends within 15 s, every process of its tree with it (no orphan), rank 0 prints ``interrupted at step N; saved
  <dir>/step-N; resume with --resume <dir>`` and no traceback, and step N's checkpoint is complete. While the torchrun
  one trains, a second ``launch.sh`` on the same ``--save`` is refused within a second, once.
* SIGTERM (a scheduler's preemption) to the ``deepspeed`` runner itself, not launch.sh (the runner passes nothing
  on: the workers see it exit), then ``--resume``: the losses of both segments are those of one process training
  the whole global batch (:func:`tests.dist.reference.gpt_reference`).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from plugin.engines.choose import importable
from plugin.job.supervise import tree

from .reference import gpt_reference
from .runs import ROOT, cpu_env, launcher_argv, recipe_variant, release_deepspeed_shm

pytestmark = [pytest.mark.dist, pytest.mark.native]
DEEPSPEED = [pytest.mark.deepspeed, pytest.mark.slow,
             pytest.mark.skipif(not importable("deepspeed"), reason="deepspeed not installed")]
LAUNCHERS = [pytest.param("deepspeed", marks=DEEPSPEED), "torchrun",
             pytest.param("accelerate", marks=pytest.mark.skipif(not importable("accelerate"),
                                                                 reason="accelerate not installed"))]
SAVE_EVERY, LONG = 3, 400  # a run that would last minutes: the signal ends it


def _recipe(tmp: Path) -> Path:
    return recipe_variant("cpu_dp4", tmp, "stop_dp2", parallelism={"data": 2, "tensor": 1, "pipeline": 1},
                          batch={"global": 8, "micro": 4}, zero={"stage": 0},
                          cluster={"nodes": 1, "gpus_per_node": 2, "gpu_memory_gb": 4})


def _complete(ckpt: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in ckpt.glob("step-*") if re.fullmatch(r"step-\d{8}", p.name)
                  and (p / ".metadata").exists()) if ckpt.exists() else []


def _losses(metrics: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines())}


def _start(cmd, tmp: Path, log: Path, env=None) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=tmp, env=env or cpu_env(), stdout=subprocess.DEVNULL, stderr=open(log, "w"),
                            start_new_session=True)  # its own group: the signal goes to the one pid we name


def _interrupt(proc: subprocess.Popen, target: int, ckpt: Path, log: Path, signum: int) -> tuple[int, float, str]:
    """Wait for the first complete save, send ``signum`` to ``target``; (exit status, seconds until the last process of
    the job's tree had gone, stderr), having checked that none outlives 15 s."""
    start = time.monotonic()
    while not _complete(ckpt):
        assert proc.poll() is None and time.monotonic() - start < 300, log.read_text()[-3000:]
        time.sleep(0.05)
    procs = {pid: started for pid, (_, started) in tree(proc.pid).items()}
    assert procs, "no launcher tree"
    sent = time.monotonic()
    os.kill(target, signum)
    try:
        code = proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"still running 15 s after {signal.Signals(signum).name}: {log.read_text()[-3000:]}")
    while True:  # a launcher that dies at once (the deepspeed runner) leaves its workers to end on their own
        left = [pid for pid, started in procs.items() if _same(pid, started)]
        if not left or time.monotonic() > sent + 15:
            break
        time.sleep(0.1)
    assert not left, f"left behind 15 s after the signal: {left}: {log.read_text()[-3000:]}"
    return code, time.monotonic() - sent, log.read_text()


def _same(pid: int, started: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] not in ("Z", "X") and int(fields[19]) == started


def _stopped_at(err: str, ckpt: str) -> int:
    assert "Traceback" not in err, err[-4000:]
    found = re.findall(r"^interrupted at step (\d+); saved (\S+); resume with --resume (\S+)$", err, re.M)
    assert len(found) == 1, err[-4000:]
    step, saved, resume = found[0]
    assert (saved, resume) == (f"{ckpt}/step-{int(step):08d}", ckpt), found
    return int(step)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_sigint_to_launch_sh_saves_the_step_and_leaves_nothing(launcher, tmp_path):
    recipe = _recipe(tmp_path)
    cmd = [str(ROOT / "launch.sh"), "--launcher", launcher, str(recipe), "--", "--steps", str(LONG),
           "--save", "ck", "--save-every", str(SAVE_EVERY)]
    log = tmp_path / "run.log"
    proc = _start(cmd, tmp_path, log)
    try:
        if launcher == "torchrun":  # one job per directory, asked while the first one lives (every suite has torchrun)
            while not (tmp_path / "ck" / "plugin-job.lock").exists():
                assert proc.poll() is None, log.read_text()[-3000:]
                time.sleep(0.05)
            begin = time.monotonic()
            second = subprocess.run(cmd, cwd=tmp_path, env=cpu_env(), capture_output=True, text=True, timeout=30)
            refused_in = time.monotonic() - begin
            print(f"second job refused in {refused_in:.2f} s: {second.stderr.strip()}")
            assert second.returncode == 2 and second.stderr.count("another job is training") == 1, second.stderr
            assert refused_in < 1.0
        code, seconds, err = _interrupt(proc, proc.pid, tmp_path / "ck", log, signal.SIGINT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    step = _stopped_at(err, "ck")
    print(f"{launcher}: launch.sh exit {code} {seconds:.1f} s after SIGINT, saved step {step}")
    assert code == 130 and step in _complete(tmp_path / "ck") and step % SAVE_EVERY  # the stop's own save
    assert not (tmp_path / "ck" / "plugin-job.lock").exists()


@pytest.mark.deepspeed
@pytest.mark.slow
@pytest.mark.skipif(not importable("deepspeed"), reason="deepspeed not installed")
def test_sigterm_to_the_deepspeed_runner_then_resume_gives_one_process_s_losses(tmp_path):
    recipe = _recipe(tmp_path)
    argv = launcher_argv("deepspeed", 2)
    port = argv[argv.index("--master_port") + 1]
    base = argv + [str(ROOT / "train.py"), "--recipe", str(recipe), "--save", "ck", "--save-every", str(SAVE_EVERY)]
    first, log = tmp_path / "first.jsonl", tmp_path / "first.log"
    proc = _start(base + ["--steps", str(LONG), "--metrics", str(first)], tmp_path, log)
    try:
        code, seconds, err = _interrupt(proc, proc.pid, tmp_path / "ck", log, signal.SIGTERM)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        release_deepspeed_shm(port)
    step = _stopped_at(err, "ck")
    print(f"deepspeed runner: exit {code} {seconds:.1f} s after SIGTERM, saved step {step}")
    losses = _losses(first)
    assert max(losses) == step
    second = tmp_path / "second.jsonl"
    resumed = subprocess.run(base + ["--steps", str(step + 2), "--resume", "ck", "--metrics", str(second)],
                             cwd=tmp_path, env=cpu_env(), capture_output=True, text=True, timeout=300)
    release_deepspeed_shm(port)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    after = _losses(second)
    assert sorted(after) == [step + 1, step + 2]
    import plugin

    reference, _ = gpt_reference(plugin.load_recipe(recipe), step + 2)
    got = [{**losses, **after}[s] for s in range(1, step + 3)]
    assert got == pytest.approx(reference, rel=1e-4), (got, reference)
