"""The batch script ``python -m plugin sbatch RECIPE`` writes (pure: no torch).

:func:`plan_batch` turns a recipe and the command's options into a :class:`BatchJob` (or the problems that stop it,
each with its fix): nodes from the recipe's cluster block (or ``--nodes``), processes per node from its world (or,
for ``"data": "auto"``, its ``gpus_per_node``), GPUs per node, or with ``--cpu`` CPUs instead. :func:`batch_script`
writes it: one task per node (launch.sh starts a torchrun on each with srun), ``--requeue``,
``--open-mode=append`` (every start appends to one output file), ``--signal=B:USR1@LEAD`` with a shell trap that
requeues the job near its time limit, and ``launch.sh RECIPE -- --save DIR --resume auto ...``, so every start
resumes from the last step saved.

The time limit's signal goes to the batch shell (``B:``), which asks ``scontrol requeue``: Slurm then stops the job
as it does on a preemption (SIGTERM to every process, each rank saves its step within KillWait) and starts it again.
The lead is train.py's grace (its ``--grace``, 25 s by default) plus :data:`SIGNAL_MARGIN_S` for the requeue to
reach every node; Slurm may send the signal up to a minute early, never late.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from ...errors import Problem
from ...job.interrupt import GRACE_S
from ..argv import train_option

SIGNAL_MARGIN_S = 60  # the requeue's round trip and the signal's delivery, beyond the ranks' own grace
MIN_TRAIN_S = 60  # a time limit must leave at least this much training before the signal
CPUS_PER_PROCESS = {"cpu": 1, "gpu": 4}  # --cpus-per-task = processes per node x this (--cpus-per-process changes it)
OWN_FLAGS = ("--save", "--resume", "--elastic")  # TRAIN_ARGS the script writes itself, or cannot carry


@dataclass(frozen=True)
class BatchOptions:
    """What ``python -m plugin sbatch`` was asked for (None: from the recipe, or Slurm's default)."""

    nodes: int | None = None
    gpus_per_node: int | None = None
    cpu: bool = False
    cpus_per_process: int | None = None
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    save: str | None = None
    train_args: tuple = ()


@dataclass(frozen=True)
class BatchJob:
    """The batch script's content, decided (:func:`batch_script` writes it)."""

    name: str
    recipe: str  # the recipe file, absolute
    layout: str  # data D x tensor T x pipeline P
    nodes: int
    per_node: int
    cpu: bool
    cpus_per_task: int
    signal_lead_s: int
    workdir: str  # --chdir: relative paths (the save directory, TRAIN_ARGS') are the writer's
    python: str
    launch_sh: str
    command: str  # the command that wrote the script
    save: str | None = None  # None: checkpoints/NAME-$SLURM_JOB_ID, one directory per job, the same at every start
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    train_args: tuple = field(default_factory=tuple)


def time_seconds(text: str) -> int | None:
    """Slurm's ``--time`` in seconds: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``;
    None for ``UNLIMITED``/``INFINITE``. ValueError for anything else."""
    if text.strip().upper() in ("UNLIMITED", "INFINITE"):
        return None
    found = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not found:
        raise ValueError(f"--time {text!r}: expected Slurm's MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS")
    days, a, b, c = found.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        parts = [int(a), int(b or 0), int(c or 0)]
        return int(days) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]
    if c is not None:  # HH:MM:SS
        return int(a) * 3600 + int(b) * 60 + int(c)
    return int(a) * 60 + int(b or 0)  # MM or MM:SS



def signal_lead(train_args) -> int:
    """Seconds before the time limit for its signal: train.py's ``--grace`` (or its default) + the margin."""
    grace = train_option(train_args, "--grace")
    try:
        seconds = float(grace) if grace is not None else GRACE_S
    except ValueError:
        seconds = GRACE_S  # train.py refuses it at start
    return int(-(-seconds // 1)) + SIGNAL_MARGIN_S


def check_train_args(train_args) -> list[Problem]:
    """TRAIN_ARGS the script writes itself (``--save``, ``--resume``), or a fixed allocation cannot run
    (``--elastic``)."""
    problems = []
    for flag in OWN_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in train_args):
            fix = {"--save": "give it to plugin sbatch before the -- (--save DIR): the script passes it on",
                   "--resume": "drop it: every start of the job runs --resume auto (the save directory's last step)",
                   "--elastic": "drop it: a Slurm job's nodes are fixed; a requeue starts it again on as many"}[flag]
            problems.append(Problem(flag, f"TRAIN_ARGS has {flag}, which the batch script sets itself"
                                    if flag != "--elastic" else "TRAIN_ARGS has --elastic", fix))
    return problems


def check_cluster_flags(recipe, opts: BatchOptions) -> list[Problem]:
    """``--nodes`` and ``--gpus-per-node`` where the recipe's cluster block says otherwise."""
    c, problems = recipe.cluster, []
    if c is None:
        return problems
    for flag, given, key, value in (("--nodes", opts.nodes, "nodes", c.nodes),
                                    ("--gpus-per-node", opts.gpus_per_node, "gpus_per_node", c.gpus_per_node)):
        if given is not None and given != value:
            problems.append(Problem(f"$.cluster.{key}", f"the recipe's cluster has {key} {value}, and {flag} "
                                    f"{given} says otherwise", f"drop {flag} (the cluster block gives it), or set "
                                    f"cluster.{key} to {given} in the recipe", file=str(recipe.source)))
    return problems


def job_shape(recipe, opts: BatchOptions) -> tuple[tuple[int, int] | None, list[Problem]]:
    """((nodes, processes per node), problems) from the recipe's world and cluster block, or the flags."""
    c, par, source = recipe.cluster, recipe.parallelism, str(recipe.source)
    nodes = opts.nodes or (c.nodes if c is not None else 1)
    slots = opts.gpus_per_node or (c.gpus_per_node if c is not None else None)
    if par.data == "auto":
        if slots is None:
            return None, [Problem("$.parallelism.data", '"auto" fills the world from the processes per node, and '
                                  "neither a cluster block nor --gpus-per-node gives them",
                                  "pass --gpus-per-node G, or give the recipe a cluster block", file=source)]
        return (nodes, slots), []
    world = par.data * par.tensor * par.pipeline * par.context
    if world % nodes:
        return None, [Problem("$.cluster.nodes" if c is not None and opts.nodes is None else "--nodes",
                              f"the recipe's {world} processes do not split evenly over {nodes} nodes",
                              "use a number of nodes that divides them", file=source)]
    per_node = world // nodes
    if slots is not None and per_node > slots:
        return None, [Problem("$.cluster", f"the recipe's {world} processes on {nodes} node(s) are {per_node} per "
                              f"node, more than its {slots} GPUs per node", f"use nodes >= {-(-world // slots)}",
                              file=source)]
    return (nodes, per_node), []


def check_time(time: str | None, lead: int) -> list[Problem]:
    if time is None:
        return []
    try:
        seconds = time_seconds(time)
    except ValueError as e:
        return [Problem("--time", str(e), "e.g. --time 4:00:00 (four hours) or --time 1-00:00:00 (a day)")]
    if seconds is not None and seconds < lead + MIN_TRAIN_S:
        return [Problem("--time", f"{time} ({seconds} s) leaves no training before the time limit's signal, "
                        f"{lead} s before the end", f"give at least {(lead + MIN_TRAIN_S + 59) // 60} minutes")]
    return []


def plan_batch(recipe, opts: BatchOptions, *, python: str, launch_sh: str, workdir: str,
               command: str) -> tuple[BatchJob | None, list[Problem]]:
    """The job for ``recipe`` (valid), or None with every problem (each with its fix)."""
    lead = signal_lead(opts.train_args)
    problems = check_cluster_flags(recipe, opts) + check_train_args(opts.train_args) + check_time(opts.time, lead)
    shape, more = job_shape(recipe, opts)
    problems += more
    if problems or shape is None:
        return None, problems
    nodes, per_node = shape
    cpus = opts.cpus_per_process or CPUS_PER_PROCESS["cpu" if opts.cpu else "gpu"]
    par = recipe.parallelism
    data = par.data if par.data != "auto" else nodes * per_node // (par.tensor * par.pipeline * par.context)
    from ...recipe.layout import layout_words

    return BatchJob(name=recipe.name, recipe=str(recipe.source), nodes=nodes, per_node=per_node, cpu=opts.cpu,
                    layout=layout_words(data, par.tensor, par.pipeline, par.context),
                    cpus_per_task=per_node * cpus, signal_lead_s=lead, workdir=workdir, python=python,
                    launch_sh=launch_sh, command=command, save=opts.save, time=opts.time, partition=opts.partition,
                    account=opts.account, train_args=tuple(opts.train_args)), []


def save_words(job: BatchJob) -> str:
    """The save directory as the script's shell reads it (the default names the job: the same at every start)."""
    if job.save is not None:
        return shlex.quote(job.save)
    return shlex.quote(f"checkpoints/{job.name}-") + '"$SLURM_JOB_ID"'


def batch_script(job: BatchJob) -> str:
    """The batch script's text (bash)."""
    where = "CPU nodes" if job.cpu else "GPU nodes"
    head = [
        "#!/bin/bash",
        f"# {job.name}: {job.layout}, {job.nodes} node{'s' if job.nodes != 1 else ''} x {job.per_node} processes "
        f"({where}).",
        f"# Written by: {job.command}",
        f"#SBATCH --job-name={job.name}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={job.cpus_per_task}",
    ]
    if not job.cpu:
        head.append(f"#SBATCH --gpus-per-node={job.per_node}")
    head += [f"#SBATCH --{flag}={value}" for flag, value in
             (("partition", job.partition), ("account", job.account), ("time", job.time)) if value]
    head += [
        f"#SBATCH --chdir={job.workdir}",
        f"#SBATCH --output={job.name}-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:USR1@{job.signal_lead_s}",
    ]
    launch = (f"PYTHON={shlex.quote(job.python)} {shlex.quote(job.launch_sh)} {shlex.quote(job.recipe)} -- "
              f"--save {save_words(job)} --resume auto" + (f" {shlex.join(job.train_args)}" if job.train_args else ""))
    body = [
        "",
        "# Preemption, scontrol requeue, scancel: Slurm sends SIGTERM to every process of the job, and each rank",
        "# finishes its step and saves it (train.py's --grace, below Slurm's KillWait). A requeued job runs this",
        "# script again, and --resume auto goes on from the saved step. Near the time limit Slurm signals this shell",
        f"# (USR1, {job.signal_lead_s} s before), which requeues the job the same way.",
        "export PYTHONUNBUFFERED=1",
        'say() { echo "$(date \'+%F %T\') slurm: job $SLURM_JOB_ID start $((${SLURM_RESTART_COUNT:-0} + 1)): $*"; }',
        "trap 'say \"the time limit is near: scontrol requeue\"; scontrol requeue \"$SLURM_JOB_ID\"' USR1",
        "trap 'say \"SIGTERM: every rank saves its step\"' TERM",
        'say "on $SLURM_JOB_NODELIST"',
        f"{launch} &",
        "launch=$!",
        "while true; do  # a trapped signal ends wait early; launch.sh goes on until the ranks have saved",
        '    wait "$launch"; status=$?',
        '    kill -0 "$launch" 2>/dev/null || break',
        "done",
        'say "launch.sh exited with $status"',
        'exit "$status"',
    ]
    return "\n".join(head + body) + "\n"
