"""The Slurm allocation launch.sh runs in, read from Slurm's environment and ``scontrol`` (pure: no torch).

Slurm exports ``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST`` (compressed: ``gpu[01-04]``), ``SLURM_JOB_NUM_NODES``,
``SLURM_GPUS_ON_NODE`` (or ``SLURM_GPUS_PER_NODE``, ``SLURM_JOB_GPUS``) where GPUs were asked for,
``SLURM_CPUS_PER_TASK``, ``SLURM_RESTART_COUNT`` after a requeue, ``SLURMD_NODENAME`` where the shell runs under
slurmd (a batch script, on the allocation's first node) and ``SLURM_STEP_ID`` inside a job step (``srun``).
``scontrol show hostnames`` expands the node list, and ``scontrol show node`` gives a node's address (its NodeAddr,
which is the node's name unless the cluster says otherwise).
"""
from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from ...errors import PluginError

SCONTROL_TIMEOUT_S = 30


class SlurmError(PluginError):
    """What Slurm's environment or ``scontrol`` says cannot be read (the message names it and the fix)."""


@dataclass(frozen=True)
class Allocation:
    """A Slurm job's allocation, as launch.sh sees it from inside."""

    job_id: str
    nodes: tuple[str, ...]  # the node names, in Slurm's order (the first hosts the rendezvous)
    nodelist: str  # SLURM_JOB_NODELIST as Slurm writes it (n[1-2])
    gpus_per_node: int  # 0: no GPU asked for (CPU nodes)
    cpus_per_task: int | None = None  # SLURM_CPUS_PER_TASK (srun does not inherit it in Slurm 22.05)
    restart: int = 0  # SLURM_RESTART_COUNT: how many times the job was requeued
    this_node: str | None = None  # SLURMD_NODENAME: the node this shell runs on, if under slurmd
    step: str | None = None  # SLURM_STEP_ID: launch.sh runs inside a job step (srun)
    step_tasks: int = 1  # SLURM_STEP_NUM_TASKS there

    @property
    def run_id(self) -> str:
        """The job's run id: torchrun's rendezvous id and the ``--save`` lock's, the same at every (re)start."""
        return f"slurm-{self.job_id}"

    def words(self) -> str:
        """``Slurm job 12 (start 2) on n1, n2`` (``start`` only after a requeue)."""
        again = f" (start {self.restart + 1})" if self.restart else ""
        return f"Slurm job {self.job_id}{again} on {', '.join(self.nodes)}"


def in_allocation(environ: Mapping[str, str]) -> bool:
    return bool(environ.get("SLURM_JOB_ID", "").strip())


def _int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise SlurmError(f"{name}={value!r} is not a whole number -> run launch.sh in a Slurm job's own environment "
                         "(sbatch or salloc), or unset SLURM_JOB_ID to launch on this machine alone") from None


def gpus_per_node(environ: Mapping[str, str]) -> int:
    """The GPUs the job holds on each node: ``SLURM_GPUS_ON_NODE`` (the batch shell's), else ``SLURM_GPUS_PER_NODE``
    (``4``, ``a100:4``, ``a100:2,v100:2``), else the indices in ``SLURM_JOB_GPUS`` (``0,1,2,3``); 0 when none."""
    on_node = _int(environ, "SLURM_GPUS_ON_NODE")
    if on_node is not None:
        return on_node
    per_node = environ.get("SLURM_GPUS_PER_NODE", "").strip()
    if per_node:
        counts = [part.rsplit(":", 1)[-1] for part in per_node.split(",")]
        if all(c.isdigit() for c in counts):
            return sum(map(int, counts))
        raise SlurmError(f"SLURM_GPUS_PER_NODE={per_node!r}: expected a count such as 4 or a100:4 -> pass --nproc N "
                         "(processes per node) to launch.sh")
    job_gpus = environ.get("SLURM_JOB_GPUS", "").strip()
    return len([g for g in job_gpus.split(",") if g.strip()]) if job_gpus else 0


def allocation_from(environ: Mapping[str, str], hostnames: list[str]) -> Allocation:
    """The allocation from Slurm's environment and the node list expanded (``scontrol show hostnames``)."""
    job = environ.get("SLURM_JOB_ID", "").strip()
    if not job:
        raise SlurmError("SLURM_JOB_ID is not set: not inside a Slurm allocation -> run launch.sh in a batch script "
                         "(python -m plugin sbatch RECIPE writes one) or an salloc shell")
    count = _int(environ, "SLURM_JOB_NUM_NODES") or _int(environ, "SLURM_NNODES")
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""
    if not hostnames:
        raise SlurmError(f"Slurm job {job}: SLURM_JOB_NODELIST={nodelist!r} names no node -> run launch.sh in the "
                         "job's own environment")
    if count is not None and count != len(hostnames):
        raise SlurmError(f"Slurm job {job}: SLURM_JOB_NUM_NODES={count}, but its node list {nodelist} has "
                         f"{len(hostnames)} node(s) -> run launch.sh in the job's own environment")
    return Allocation(job_id=job, nodes=tuple(hostnames), nodelist=nodelist, gpus_per_node=gpus_per_node(environ),
                      cpus_per_task=_int(environ, "SLURM_CPUS_PER_TASK"),
                      restart=_int(environ, "SLURM_RESTART_COUNT") or 0,
                      this_node=environ.get("SLURMD_NODENAME") or None,
                      step=environ.get("SLURM_STEP_ID") or None,
                      step_tasks=_int(environ, "SLURM_STEP_NUM_TASKS") or 1)


def scontrol(*args: str) -> str:
    """``scontrol ARGS``'s output, or :class:`SlurmError` with what went wrong."""
    exe = shutil.which("scontrol")
    if exe is None:
        raise SlurmError("SLURM_JOB_ID is set but scontrol is not on PATH -> run launch.sh where Slurm's client "
                         "commands are installed, or unset SLURM_JOB_ID to launch on this machine alone")
    try:
        out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"scontrol {' '.join(args)} did not answer in {SCONTROL_TIMEOUT_S} s -> check that "
                         "slurmctld is reachable (scontrol ping)") from None
    if out.returncode != 0:
        raise SlurmError(f"scontrol {' '.join(args)} failed: {out.stderr.strip() or out.returncode} -> check the "
                         "job's environment (SLURM_JOB_NODELIST) and that slurmctld answers (scontrol ping)")
    return out.stdout


def read_allocation(environ: Mapping[str, str]) -> Allocation:
    """The allocation launch.sh runs in (:class:`SlurmError` when Slurm cannot say)."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""
    hostnames = scontrol("show", "hostnames", nodelist).split() if nodelist else []
    return allocation_from(environ, hostnames)


def node_address(text: str, node: str) -> str:
    """The ``NodeAddr`` in ``scontrol show node -o NODE``'s line, else the node's name (Slurm's default address)."""
    found = re.search(r"(?:^|\s)NodeAddr=(\S+)", text)
    return found.group(1) if found and found.group(1) not in ("(null)", "") else node


def address_of(node: str) -> str:
    """Where the other nodes reach ``node``: its Slurm NodeAddr (its name unless the cluster maps it)."""
    return node_address(scontrol("show", "node", "-o", node), node)
