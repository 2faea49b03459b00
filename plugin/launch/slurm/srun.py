"""launch.sh inside a Slurm allocation: one torchrun per node with ``srun``, a c10d rendezvous on the first node
(pure: no torch).

:func:`launch_in_allocation` reads the allocation, refuses what does not fit before anything starts (:mod:`.fit`,
then the recipe's checks at the whole world size), and runs ``srun --nodes=N --ntasks-per-node=1 torchrun --nnodes N
--nproc_per_node P --rdzv_backend c10d --rdzv_endpoint FIRST:PORT --rdzv_id slurm-JOB train.py ...`` (torchrun
through :mod:`.agent`, which says in one line what its traceback would say when Slurm stops the job). The run id
``slurm-JOB`` is the same at every start of a requeued job: train.py's ``--save`` lock and its ``--resume auto`` ledger
know the job by it. Under a batch script launch.sh runs on the first node and takes a free port there; elsewhere
(an salloc shell) the port is derived from the job id.

Stopping: Slurm sends its SIGTERM (preemption, ``scontrol requeue``, ``scancel``, a time limit) to every process of the
job itself: each rank stops at its step boundary and saves (:mod:`plugin.job.interrupt`), within Slurm's KillWait.
launch.sh passes nothing on there: a second SIGTERM would cut torchrun's wait for its workers short. A SIGINT
(Ctrl-C) reaches every process of the job's steps through ``scancel --signal=INT``, as does a SIGTERM to a launch.sh
that runs outside slurmd (an salloc shell on a login node, where Slurm's own signal does not reach it).
"""
from __future__ import annotations

import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ...job.interrupt import ECHO_S
from ...job.lock import live_holder, refusal, used_refusal
from ..argv import train_option
from .allocation import Allocation, SlurmError, address_of, read_allocation
from .fit import fit_allocation

AGENT = "plugin.launch.slurm.agent"  # torchrun, quiet about Slurm's SIGTERM (:mod:`.agent`)
PORT_BASE, PORT_SPAN = 20000, 10000  # a port from the job id where launch.sh cannot look for a free one


def rendezvous_port(alloc: Allocation) -> int:
    """A free port on the first node when launch.sh runs there (a batch script does), else one from the job id."""
    if alloc.this_node is not None and alloc.this_node == alloc.nodes[0]:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]
    digits = "".join(ch for ch in alloc.job_id if ch.isdigit()) or "0"
    return PORT_BASE + int(digits) % PORT_SPAN


def srun_command(python: str, alloc: Allocation, per_node: int, endpoint: str, train: list[str]) -> list[str]:
    """``srun`` of one torchrun agent per node; ``train`` is train.py and its arguments."""
    nodes = len(alloc.nodes)
    cmd = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if alloc.cpus_per_task:  # Slurm 22.05's srun does not inherit the job's --cpus-per-task
        cmd.append(f"--cpus-per-task={alloc.cpus_per_task}")
    if alloc.step is not None:  # inside an interactive step (srun --pty bash), which holds the CPUs
        cmd.append("--overlap")
    return cmd + [python, "-m", AGENT, "--nnodes", str(nodes), "--nproc_per_node", str(per_node),
                  "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", alloc.run_id, *train]


def refuse_launcher(requested: str, alloc: Allocation) -> str | None:
    if requested in ("auto", "torchrun"):
        return None
    who = "DeepSpeed's launcher" if requested == "deepspeed" else "accelerate launch"
    return (f"--launcher {requested} inside {alloc.words()}: launch.sh starts torchrun on every node with srun there, "
            f"and train.py picks the same back end under it (DeepSpeed's engine included) -> drop --launcher, or "
            f"pass --nodes/--master yourself to run {who} outside Slurm's srun")


def step_refusal(alloc: Allocation) -> str | None:
    if alloc.step is None or alloc.step_tasks == 1:
        return None
    return (f"launch.sh runs in step {alloc.step} of Slurm job {alloc.job_id}, one of its {alloc.step_tasks} tasks "
            "(srun launch.sh): each would start the whole job -> run launch.sh once, in the batch script or the "
            "salloc shell; it starts one torchrun per node itself")


class _Stop:
    """launch.sh's signals while srun runs (module docstring)."""

    def __init__(self, job_id: str, forward_term: bool):
        self.job_id, self.forward_term = job_id, forward_term
        self.signum, self.first = 0, 0.0

    def _scancel(self, signum: int) -> None:
        name = signal.Signals(signum).name[3:]
        subprocess.run(["scancel", "--quiet", f"--signal={name}", self.job_id], check=False)

    def __call__(self, signum, frame) -> None:
        now = time.monotonic()
        if not self.signum:
            self.signum, self.first = signum, now
            if signum == signal.SIGINT or self.forward_term:
                self._scancel(signum)
        elif signum == signal.SIGINT and now - self.first >= ECHO_S:  # a second Ctrl-C: every rank stops at once
            self._scancel(signal.SIGINT)


def run_step(cmd: list[str], env: dict, alloc: Allocation) -> int:
    """Run ``srun`` to its end; launch.sh's exit status (128 + a signal's number when one stopped it)."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)  # a terminal's Ctrl-C reaches launch.sh alone
    stop = _Stop(alloc.job_id, forward_term=alloc.this_node is None)
    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    return 128 + stop.signum if stop.signum else code



def launch_in_allocation(req, machine, environ, root: Path, train_checks) -> int:
    """launch.sh's whole run inside a Slurm allocation, its exit status. ``req``: launch.sh's parsed request;
    ``root``: the checkout holding train.py; ``train_checks(recipe)``: what train.py needs beyond a valid recipe."""
    from ...recipe.checks import validate

    try:
        alloc = read_allocation(environ)
    except SlurmError as e:
        print(f"launch.sh: {e}", file=sys.stderr)
        return 1
    refused = refuse_launcher(req.launcher, alloc) or step_refusal(alloc)
    if refused:
        print(f"launch.sh: {refused}", file=sys.stderr)
        return 1
    save = None if req.dry_run else train_option(req.train_args, "--save")
    if save:  # another job on the directory; this job's earlier start (same run id) is not another job
        holder = live_holder(save, alloc.run_id)
        refused = refusal(save, holder) if holder else used_refusal(
            save, resume=train_option(req.train_args, "--resume") is not None)
        if refused:
            print(refused, file=sys.stderr)
            return 2
    recipe, problems = validate(req.recipe)
    for p in problems:
        print(p.format(), file=sys.stderr)
    if recipe is None:
        return 2
    per_node, problems = fit_allocation(recipe, alloc, req.nproc)
    if per_node is not None:
        _, checked = validate(req.recipe, per_node * len(alloc.nodes))
        problems += [p for p in checked if p.is_error]
    problems += train_checks(recipe)
    if problems:
        print("\n".join(p.format() for p in problems), file=sys.stderr)
        if any(p.is_error for p in problems):
            return 2
    try:
        address = address_of(alloc.nodes[0])
    except SlurmError as e:
        print(f"launch.sh: {e}", file=sys.stderr)
        return 1
    endpoint = f"{address}:{rendezvous_port(alloc)}"
    train = [str(root / "train.py"), "--recipe", str(Path(recipe.source).resolve()), *req.train_args]
    cmd = srun_command(machine.python, alloc, per_node, endpoint, train)
    env = {"PLUGIN_RUN_ID": alloc.run_id}
    if not alloc.gpus_per_node and not machine.gpus:
        env.update(OMP_NUM_THREADS=environ.get("OMP_NUM_THREADS", "1"), DS_ACCELERATOR="cpu")
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(cmd)
    print(f"slurm: {alloc.words()}: {len(alloc.nodes)} x {per_node} processes, rendezvous on {alloc.nodes[0]} "
          f"({endpoint})", file=sys.stderr, flush=True)
    if req.dry_run:
        print(shown)
        return 0
    print(f"+ {shown}", file=sys.stderr, flush=True)
    return run_step(cmd, {**environ, **env}, alloc)
