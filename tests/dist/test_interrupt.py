"""Ctrl-C and preemption on real launchers (issues 21 and 32): 2 processes, data parallel, the only save the stop's own.

* A signal to ``launch.sh`` once a step is trained, one launch per launcher (SIGINT with torchrun and deepspeed,
  SIGTERM with accelerate): it ends with 128 + the signal's number, every process of its tree with it (no orphan),
  rank 0 prints ``interrupted at step N; saved <dir>/step-N; resume with --resume <dir>`` and no traceback, and step
  N's checkpoint is complete. While the torchrun one trains, a second ``launch.sh`` on the same ``--save`` is refused,
  once.
* A signal to the launcher itself, not through launch.sh (SIGTERM to ``torchrun``, SIGINT to ``accelerate launch``;
  the other signal of each is ``slow``): the same stop. torchrun then exits 1 with torch's own ``SignalException``
  traceback (``_terminate_process_handler``, named in docs/stopping-a-job.md), the only traceback allowed;
  accelerate launch exits with 128 + N. While the torchrun one trains, a second ``torchrun`` on the same ``--save`` is
  refused by its rank 0 before any engine starts; its ``--metrics`` goes into a directory that did not exist.
* SIGTERM (a scheduler's preemption) to the ``deepspeed`` runner itself, not launch.sh (the runner passes nothing
  on: the workers see it exit), then ``--resume``: the losses of both segments are those of one process training
  the whole global batch (:func:`tests.dist.reference.gpt_reference`).

Every case prints the seconds from the signal until the last process of the job had gone (the aim is 15 s;
docs/stopping-a-job.md gives measured figures); the assertion's ceiling, :data:`CEILING_S`, is generous, since a
loaded machine can take several times as long.
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
ACCELERATE = pytest.mark.skipif(not importable("accelerate"), reason="accelerate not installed")
# a run that would last minutes: the signal ends it. No periodic save falls due before it (a stop that landed on a
# multiple of --save-every would share that step's save), so every checkpoint there is is the stop's own
SAVE_EVERY, LONG = 1000, 400
CEILING_S = 60  # a stop that never ends, not a slow one (the workers' grace is 25 s, torchrun's shutdown 30 s)
# torchrun's agent, sent SIGTERM or SIGINT, forwards it and then raises torch's SignalException out of its main
TORCHRUN_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):\n(?:  .*\n)+torch\.distributed\.elastic\."
                                r"multiprocessing\.api\.SignalException: Process \d+ got signal: \d+\n", re.M)


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


def _interrupt(proc: subprocess.Popen, target: int, metrics: Path, log: Path, signum: int) -> tuple[int, float, str]:
    """Wait for the first trained step in ``metrics``, send ``signum`` to ``target``; (exit status, seconds until the
    last process of the job's tree had gone, stderr), having checked that none outlives :data:`CEILING_S`."""
    start = time.monotonic()
    while not (metrics.exists() and metrics.read_text().count("\n")):
        assert proc.poll() is None and time.monotonic() - start < 300, log.read_text()[-3000:]
        time.sleep(0.05)
    procs = {pid: started for pid, (_, started) in tree(proc.pid).items()}
    assert procs, "no launcher tree"
    sent = time.monotonic()
    os.kill(target, signum)
    try:
        code = proc.wait(timeout=CEILING_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"still running {CEILING_S} s after {signal.Signals(signum).name}: "
                             f"{log.read_text()[-3000:]}") from None
    while True:  # a launcher that dies at once (the deepspeed runner) leaves its workers to end on their own
        left = [pid for pid, started in procs.items() if _same(pid, started)]
        if not left or time.monotonic() > sent + CEILING_S:
            break
        time.sleep(0.1)
    assert not left, f"left behind {CEILING_S} s after the signal: {left}: {log.read_text()[-3000:]}"
    return code, time.monotonic() - sent, log.read_text()


def _same(pid: int, started: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] not in ("Z", "X") and int(fields[19]) == started


def _stopped_at(err: str, ckpt: str, *, torchrun_traceback: bool = False) -> int:
    """The step rank 0's one line says it stopped at (and saved in ``ckpt``); no traceback but, with
    ``torchrun_traceback``, torchrun's own one (:data:`TORCHRUN_TRACEBACK`), exactly once."""
    if torchrun_traceback:
        err, found = TORCHRUN_TRACEBACK.subn("", err)
        assert found == 1, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    found = re.findall(r"^interrupted at step (\d+); saved (\S+); resume with --resume (\S+)$", err, re.M)
    assert len(found) == 1, err[-4000:]
    step, saved, resume = found[0]
    assert (saved, resume) == (f"{ckpt}/step-{int(step):08d}", ckpt), found
    return int(step)


def _wait_for_lock(proc: subprocess.Popen, ckpt: Path, log: Path) -> None:
    while not (ckpt / "plugin-job.lock").exists():
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.05)


def _second_job(cmd, tmp: Path, env) -> tuple[int, str]:
    """Start ``cmd`` again on the same ``--save`` while the first job holds it: refused (non-zero), rank 0's one line,
    no engine started; (its exit status, its stderr)."""
    begin = time.monotonic()
    second = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=CEILING_S * 2)
    print(f"second job refused in {time.monotonic() - begin:.2f} s (exit {second.returncode})")
    assert second.returncode != 0 and second.stderr.count("another job is training") == 1, second.stderr[-4000:]
    assert "start:" not in second.stderr, second.stderr[-4000:]
    return second.returncode, second.stderr


def _id(value) -> str:
    return value.name if isinstance(value, signal.Signals) else str(value)


LAUNCH_SH = [pytest.param("deepspeed", signal.SIGINT, marks=DEEPSPEED), ("torchrun", signal.SIGINT),
             pytest.param("accelerate", signal.SIGTERM, marks=ACCELERATE)]


@pytest.mark.parametrize(("launcher", "signum"), LAUNCH_SH, ids=_id)
def test_a_signal_to_launch_sh_saves_the_step_and_leaves_nothing(launcher, signum, tmp_path):
    recipe = _recipe(tmp_path)
    cmd = [str(ROOT / "launch.sh"), "--launcher", launcher, str(recipe), "--", "--steps", str(LONG),
           "--save", "ck", "--save-every", str(SAVE_EVERY), "--metrics", "m.jsonl"]
    log = tmp_path / "run.log"
    proc = _start(cmd, tmp_path, log)
    try:
        if launcher == "torchrun":  # one job per directory, asked while the first one lives (every suite has torchrun)
            _wait_for_lock(proc, tmp_path / "ck", log)
            assert _second_job(cmd, tmp_path, cpu_env())[0] == 2  # launch.sh's own refusal, no launcher started
        code, seconds, err = _interrupt(proc, proc.pid, tmp_path / "m.jsonl", log, signum)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    step = _stopped_at(err, "ck")
    print(f"{launcher}: launch.sh exit {code} {seconds:.1f} s after {signum.name}, saved step {step}")
    assert code == 128 + signum and _complete(tmp_path / "ck") == [step]  # the stop's own save, the only one
    assert not (tmp_path / "ck" / "plugin-job.lock").exists()


# torchrun's SIGTERM also runs in the venv without deepspeed (nods): there its workers stop the native engine, where the
# README's suite stops DeepSpeed's
DIRECT = [pytest.param("torchrun", signal.SIGTERM, marks=pytest.mark.nods),
          pytest.param("torchrun", signal.SIGINT, marks=pytest.mark.slow),
          pytest.param("accelerate", signal.SIGINT, marks=ACCELERATE),
          pytest.param("accelerate", signal.SIGTERM, marks=[ACCELERATE, pytest.mark.slow])]


@pytest.mark.parametrize(("launcher", "signum"), DIRECT, ids=_id)
def test_a_signal_to_torchrun_or_accelerate_itself_saves_the_step_and_leaves_nothing(launcher, signum, tmp_path):
    recipe = _recipe(tmp_path)
    cmd = launcher_argv(launcher, 2) + [str(ROOT / "train.py"), "--recipe", str(recipe), "--steps", str(LONG),
                                        "--save", "ck", "--save-every", str(SAVE_EVERY),
                                        "--metrics", "new/dir/m.jsonl"]  # a directory rank 0 makes
    env = cpu_env(ACCELERATE_USE_CPU="true") if launcher == "accelerate" else cpu_env()
    log = tmp_path / "run.log"
    proc = _start(cmd, tmp_path, log, env)
    try:
        if launcher == "torchrun" and signum == signal.SIGTERM:  # a second job started by torchrun directly
            _wait_for_lock(proc, tmp_path / "ck", log)
            code, err = _second_job(cmd, tmp_path, env)
            assert code == 1 and "exitcode  : 2" in err  # torchrun's own report (ChildFailedError) of rank 0's exit 2
        code, seconds, err = _interrupt(proc, proc.pid, tmp_path / "new" / "dir" / "m.jsonl", log, signum)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    step = _stopped_at(err, "ck", torchrun_traceback=launcher == "torchrun")
    print(f"{launcher}: exit {code} {seconds:.1f} s after {signum.name} to it, saved step {step}")
    assert code == (1 if launcher == "torchrun" else 128 + signum)
    assert _complete(tmp_path / "ck") == [step]  # the stop's own save, the only one
    assert max(_losses(tmp_path / "new" / "dir" / "m.jsonl")) == step
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
        code, seconds, err = _interrupt(proc, proc.pid, first, log, signal.SIGTERM)
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
