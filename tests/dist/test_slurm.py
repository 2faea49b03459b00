"""A recipe through a real Slurm (issue 35): ``python -m plugin sbatch`` to a running, stopped, requeued and finished
job, on a Slurm of two nodes on this host (:mod:`.slurm_cluster`, started once for the module, nothing left running
after it). Marker ``slurm``: .ci/run runs these in a step of their own, with ``PLUGIN_REQUIRE=slurm`` so that they
fail where Slurm cannot run instead of skipping.

* A recipe for 2 nodes submitted on 1 (``sbatch --nodes=1`` over the script's own ``--nodes=2``): launch.sh refuses
  it with one line and exit 2 before any worker starts (no srun, no ``start:`` line, no save directory).
* 4 processes on one node (cpu_tp2_dp2, DeepSpeed's engine): trains one process's losses; ``scancel`` mid-run
  stops every rank at its step boundary with the step saved, the job ends CANCELLED (not requeued) and no process of
  it is left.
* tensor 2 x data 2 over the two nodes (the native engine: the job above ran DeepSpeed's): the time limit's signal
  (``scancel --batch --signal=USR1``, what ``--signal=B:USR1@LEAD`` sends) and then ``scontrol requeue`` (what a
  preemption does) each stop it with the step saved; Slurm starts it again, it resumes (``resumed at step N``), and
  it finishes with one process's losses at every step, the metrics file one timeline over the three starts. The
  timeline is printed (``-s`` shows it).
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .reference import gpt_reference
from .runs import ROOT, cpu_env, recipe_variant
from .slurm_cluster import SlurmCluster, need_slurm

pytestmark = [pytest.mark.dist, pytest.mark.slurm]

STEPS = 20  # the requeued job's; the one-process reference covers them
LONG = 400  # the cancelled job's: scancel ends it
WAIT_S = 600  # any one wait (a start under load takes minutes here); never a bound on how fast things are


def rtol(step: int) -> float:
    """One process's losses: to 1e-4 up to step 10, 1e-3 after (../shared/FACTS.md: from step 11 micro-batch splits and
    tensor 2 layouts drift up to 2e-4 from one process, and are back by step 20)."""
    return 1e-4 if step <= 10 else 1e-3


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    need_slurm()
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    try:
        yield cluster
    finally:
        left = cluster.stop()
    assert not left, "left running after the Slurm tests (killed now):\n" + "\n".join(left)


@pytest.fixture(scope="module")
def reference():
    """{step: loss} of one process training cpu_tp2_dp2's global batches (the jobs' layouts, 2 or 1 nodes alike)."""
    import plugin

    losses, _ = gpt_reference(plugin.load_recipe("cpu_tp2_dp2"), STEPS)
    return dict(enumerate(losses, start=1))


def job_env(cluster: SlurmCluster) -> dict:
    """What sbatch passes on to the job (its default --export=ALL): this checkout, the CPU settings, this Slurm."""
    return {**cpu_env(), "SLURM_CONF": str(cluster.conf), "PYTHONPATH": str(ROOT)}


def plugin_sbatch(cluster, cwd: Path, *argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "plugin", "sbatch", *argv], cwd=cwd, env=job_env(cluster),
                          capture_output=True, text=True, timeout=120)


def submitted(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0, out.stderr
    found = re.match(r"submitted Slurm job (\d+): ", out.stdout)
    assert found, out.stdout
    return found.group(1)


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


def output(cwd: Path, name: str, job: str) -> str:
    path = cwd / f"{name}-{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""


END_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"}


def ended(cluster, job: str, state: str):
    """A predicate for ``wait_for``: the job's fields once it is in ``state``, failing at once in another end state."""
    def check():
        fields = cluster.job(job)
        if fields.get("JobState") in END_STATES - {state}:
            raise AssertionError(f"job {job} ended {fields.get('JobState')}, not {state}: {fields}")
        return fields if fields.get("JobState") == state else None
    return check


def running(cluster, job: str, log, until):
    """A predicate for ``wait_for``: ``until()``, failing at once if the job ended instead (no waiting it out)."""
    def check():
        value = until()
        if not value and cluster.job(job).get("JobState") in END_STATES:
            raise AssertionError(f"job {job} ended: {cluster.job(job)}\n{log()[-4000:]}")
        return value
    return check


def test_a_recipe_for_more_nodes_than_the_allocation_is_refused_before_any_worker(slurm, tmp_path):
    recipe = recipe_variant("cpu_tp2_dp2", tmp_path, "two_nodes",
                            cluster={"nodes": 2, "gpus_per_node": 2, "gpu_memory_gb": 4})
    wrote = plugin_sbatch(slurm, tmp_path, str(recipe), "--cpu", "--save", "ck", "-o", "job.sbatch", "--",
                          "--steps", "3", "--metrics", "m.jsonl")
    assert wrote.returncode == 0, wrote.stderr
    job = slurm.run("sbatch", "--parsable", "--nodes=1", "job.sbatch", cwd=tmp_path,
                    env=job_env(slurm)).stdout.strip().split(";")[0]
    fields = slurm.wait_for(f"job {job} failed", ended(slurm, job, "FAILED"), WAIT_S)
    log = output(tmp_path, "two_nodes", job)
    refusals = [line for line in log.splitlines() if "$.cluster.nodes" in line]
    assert refusals == [f"{recipe}: $.cluster.nodes: the recipe asks for 2 nodes, Slurm job {job} has 1 node (n1) -> "
                        "submit it on 2 nodes (sbatch --nodes=2; python -m plugin sbatch two_nodes writes the "
                        "script), or set cluster.nodes to 1"], log
    assert fields["ExitCode"] == "2:0", fields
    assert "+ " not in log and "srun" not in log and "start:" not in log, log  # no srun, no rank
    assert not (tmp_path / "ck").exists() and not (tmp_path / "m.jsonl").exists()


def test_four_processes_on_one_node_train_and_scancel_leaves_nothing(slurm, reference, tmp_path):
    job = submitted(plugin_sbatch(slurm, tmp_path, "cpu_tp2_dp2", "--cpu", "--save", "ck", "--submit", "--",
                                  "--steps", str(LONG), "--metrics", "m.jsonl"))
    metrics = tmp_path / "m.jsonl"
    slurm.wait_for("three steps trained", running(slurm, job, lambda: output(tmp_path, "cpu_tp2_dp2", job),
                                                  lambda: len(records(metrics)) >= 3), WAIT_S, 0.1)
    slurm.run("scancel", job)
    slurm.wait_for(f"job {job} cancelled", ended(slurm, job, "CANCELLED"), WAIT_S)
    try:  # the job has ended: its last processes (slurmstepd) are on their way out
        slurm.wait_for("no process of the job left", lambda: not slurm.left_behind(), 10)
    except AssertionError:
        pytest.fail("left behind by the cancelled job:\n" + "\n".join(slurm.left_behind()))
    time.sleep(3)  # Slurm would have requeued it by now (a requeued job is PENDING at once)
    fields = slurm.job(job)
    assert (fields["JobState"], fields["Restarts"]) == ("CANCELLED", "0"), fields
    log = output(tmp_path, "cpu_tp2_dp2", job)
    assert re.search(rf"^\S+: start: deepspeed on cpu, gloo, data 2 x tensor 2 x pipeline 1, .*, Slurm job {job} "
                     "on n1$", log, re.M), log
    stops = re.findall(r"^interrupted at step (\d+); saved ck/step-(\d+);", log, re.M)
    assert len(stops) == 1 and stops[0][0] == str(int(stops[0][1])), log
    stopped = int(stops[0][0])
    assert (tmp_path / "ck" / f"step-{stopped:08d}" / ".metadata").exists()
    losses = {r["step"]: r["loss"] for r in records(metrics)}
    assert sorted(losses) == list(range(1, stopped + 1)) and stopped <= STEPS, (sorted(losses), log[-3000:])
    for step, loss in losses.items():
        assert math.isclose(loss, reference[step], rel_tol=rtol(step)), f"step {step}: {loss} != {reference[step]}"


def _said(log: str, what: str) -> list[str]:
    """The times (HH:MM:SS) of the batch script's ``slurm: job J start K: WHAT`` lines."""
    return re.findall(rf"^\S+ (\d\d:\d\d:\d\d) slurm: job \d+ start \d+: {what}", log, re.M)


def test_two_nodes_stopped_near_the_time_limit_and_by_a_requeue_resume_and_finish(slurm, reference, tmp_path):
    recipe = recipe_variant("cpu_tp2_dp2", tmp_path, "tp2_dp2_two_nodes", launcher="torchrun",  # the native engine
                            cluster={"nodes": 2, "gpus_per_node": 2, "gpu_memory_gb": 4})
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    job = submitted(plugin_sbatch(slurm, tmp_path, str(recipe), "--cpu", "--save", "ck", "--submit", "--",
                                  "--steps", str(STEPS), "--metrics", "m.jsonl"))
    events = [(time.strftime("%H:%M:%S"), "submit: python -m plugin sbatch --submit")]

    def log() -> str:
        return output(tmp_path, "tp2_dp2_two_nodes", job)

    stops = []
    for k, (what, signal_it) in enumerate([
            ("USR1 to the batch shell (what the time limit's --signal=B:USR1 sends)",
             ["scancel", "--batch", "--signal=USR1", job]),
            ("scontrol requeue (Slurm's requeue, as a preemption's)", ["scontrol", "requeue", job])]):
        since = stops[-1] if stops else 0
        slurm.wait_for(f"start {k + 1} trains 3 steps", running(slurm, job, log, lambda k=k, since=since: sum(
            r.get("restart") == k and r["step"] > since for r in records(metrics)) >= 3), WAIT_S, 0.1)
        slurm.run(*signal_it)
        events.append((time.strftime("%H:%M:%S"), f"signal {k + 1}: {what}"))
        found = slurm.wait_for(f"stop {k + 1}'s line", running(slurm, job, log, lambda k=k: re.findall(
            r"^interrupted at step (\d+); saved ck/step-\d+;", log(), re.M)[k:]), WAIT_S)
        stops.append(int(found[0]))
        saved = (ck / f"step-{stops[-1]:08d}" / ".metadata").stat().st_mtime
        events.append((time.strftime("%H:%M:%S", time.localtime(saved)), f"save {k + 1}: step {stops[-1]} complete"))
        slurm.wait_for(f"start {k + 2}", running(slurm, job, log, lambda k=k: len(_said(log(), "on n")) >= k + 2),
                       WAIT_S)
    fields = slurm.wait_for(f"job {job} completed", ended(slurm, job, "COMPLETED"), WAIT_S)
    text = log()
    assert (fields["Restarts"], fields["ExitCode"]) == ("2", "0:0"), fields

    # each stop saved its step, the next start resumed from it; the time limit's signal went through the trap
    assert len(_said(text, "the time limit is near: scontrol requeue")) == 1, text[-4000:]
    resumed = re.findall(r"^resumed at step (\d+) after", text, re.M)
    assert resumed == [str(s + 1) for s in stops], text[-4000:]
    starts = re.findall(r"^\S+: start: (\w+) on cpu, .*, (data 2 x tensor 2 x pipeline 1), .*, Slurm job (\d+) on "
                        r"n\[1-2\](, requeued \d times?)?$", text, re.M)
    assert starts == [("native", "data 2 x tensor 2 x pipeline 1", job, again)
                      for again in ("", ", requeued 1 time", ", requeued 2 times")], text[-4000:]
    assert "Traceback" not in text and text.count("torchrun on n") == 4, text[-4000:]  # a line per node and stop

    # the metrics file: one timeline over the three starts, one process's losses at every step
    recs = records(metrics)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1)), [r["step"] for r in recs]
    assert [r["restart"] for r in recs] == [0] * stops[0] + [1] * (stops[1] - stops[0]) + [2] * (STEPS - stops[1])
    for r in recs:
        assert math.isclose(r["loss"], reference[r["step"]], rel_tol=rtol(r["step"])), \
            f"step {r['step']}: {r['loss']} != one process's {reference[r['step']]}"

    starts, ends = _said(text, "on n"), _said(text, "launch.sh exited with")
    events += [(t, f"start {k + 1}: the batch script begins" + (f", resumes at step {resumed[k - 1]}" if k else ""))
               for k, t in enumerate(starts)]
    events += [(t, f"start {k + 1} ends: " + ("requeued by Slurm" if k < 2 else "finished, COMPLETED"))
               for k, t in enumerate(ends)]
    print(f"\nSlurm job {job}, tensor 2 x data 2 on n1 and n2, {STEPS} steps, stopped at steps {stops}:\n"
          + "\n".join(f"  {t}  {what}" for t, what in sorted(events)))
