"""``sbatch RECIPE [--partition P] [--time T] [--account A] [--save DIR] [-o FILE] [--submit | --dry-run] [--cpu]
[-- TRAIN_ARGS]``: a Slurm batch script from a recipe (:mod:`plugin.launch.slurm.batch`), written to FILE (default
NAME.sbatch), printed (``--dry-run``), or written and submitted (``--submit``: prints the job id). Exit 2 when the
recipe is invalid or the flags disagree with it, 1 when sbatch fails.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from .common import EXIT_INVALID, EXIT_OK, EXIT_USAGE, positive_int, print_problems

ROOT = Path(__file__).resolve().parents[2]  # the checkout: plugin/cli/sbatch.py -> <repo> (launch.sh is there)


def register(sub) -> None:
    p = sub.add_parser("sbatch", usage="python -m plugin sbatch RECIPE [options] [-- TRAIN_ARGS]",
                       help="write (or submit) a Slurm batch script that trains a recipe, requeued and "
                       "resumed after a preemption or near its time limit",
                       description="Write a Slurm batch script from a recipe: nodes, processes and GPUs (or CPUs) per "
                       "node, --requeue, --open-mode=append, the time limit's signal turned into a requeue, and "
                       "launch.sh with --save DIR --resume auto, so that every start resumes from the last saved step.")
    p.add_argument("recipe", metavar="RECIPE", help="a path, or a shipped recipe's name (tp2_dp4)")
    p.add_argument("--partition", metavar="P", help="sbatch --partition")
    p.add_argument("--time", metavar="T", help="sbatch --time (HH:MM:SS, D-HH:MM:SS, minutes)")
    p.add_argument("--account", metavar="A", help="sbatch --account")
    p.add_argument("--save", metavar="DIR", help="the checkpoint directory every start saves to and resumes from (a "
                   "directory every node reaches; default checkpoints/NAME-JOBID)")
    p.add_argument("--nodes", type=positive_int, metavar="N", help="nodes, where the recipe has no cluster block")
    p.add_argument("--gpus-per-node", type=positive_int, metavar="G",
                   help="GPUs per node, where the recipe has no cluster block")
    p.add_argument("--cpu", action="store_true", help="nodes without GPUs: CPUs asked for instead of GPUs, the "
                   "processes per node from the recipe")
    p.add_argument("--cpus-per-process", type=positive_int, metavar="C",
                   help="CPUs per training process (default 1 with --cpu, 4 with GPUs)")
    p.add_argument("-o", "--output", metavar="FILE", help="where to write the script (default NAME.sbatch)")
    action = p.add_mutually_exclusive_group()
    action.add_argument("--submit", action="store_true", help="write it, then submit it with sbatch (prints the job "
                        "id)")
    action.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")
    p.set_defaults(run=run, train_args=[])  # after --: python -m plugin's main passes them on


def run(args) -> int:
    from ..launch.slurm.batch import BatchOptions, batch_script, plan_batch
    from ..recipe.checks import validate

    if not (ROOT / "launch.sh").exists():
        print(f"{ROOT}: no launch.sh here (an installed wheel carries neither launch.sh nor train.py) -> run "
              "python -m plugin sbatch from a checkout of the project, which every node reaches", file=sys.stderr)
        return EXIT_USAGE
    recipe, problems = validate(args.recipe)
    print_problems(problems)
    if recipe is None:
        return EXIT_INVALID
    opts = BatchOptions(nodes=args.nodes, gpus_per_node=args.gpus_per_node, cpu=args.cpu,
                        cpus_per_process=args.cpus_per_process, partition=args.partition, time=args.time,
                        account=args.account, save=args.save, train_args=tuple(args.train_args))
    command = _command(args)
    job, problems = plan_batch(recipe, opts, python=sys.executable, launch_sh=str(ROOT / "launch.sh"),
                               workdir=os.getcwd(), command=command)
    if job is None:
        print_problems(problems)
        return EXIT_INVALID
    _, checked = validate(args.recipe, job.per_node * job.nodes)  # the recipe's own rules at the job's world size
    errors = [p for p in checked if p.is_error]
    if errors:
        print_problems(errors)
        return EXIT_INVALID
    text = batch_script(job)
    if args.dry_run:
        sys.stdout.write(text)
        return EXIT_OK
    out = Path(args.output or f"{recipe.name}.sbatch")
    try:
        out.write_text(text)
    except OSError as e:
        print(f"{out}: cannot write the script: {e.strerror or e} -> give another -o FILE", file=sys.stderr)
        return EXIT_USAGE
    out.chmod(0o755)
    where = f"{job.nodes} node{'s' if job.nodes != 1 else ''} x {job.per_node} processes"
    if not args.submit:
        print(f"wrote {out}: {recipe.name}, {where}; submit it with: sbatch {shlex.quote(str(out))}")
        return EXIT_OK
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        print(f"wrote {out}, but sbatch is not on PATH -> submit it where Slurm's client commands are installed: "
              f"sbatch {shlex.quote(str(out))}", file=sys.stderr)
        return EXIT_USAGE
    done = subprocess.run([sbatch, "--parsable", str(out)], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"sbatch {out} failed: {done.stderr.strip() or done.returncode} -> fix what sbatch says (partition, "
              "account, limits) and submit it again", file=sys.stderr)
        return EXIT_USAGE
    job_id = done.stdout.strip().split(";")[0]
    print(f"submitted Slurm job {job_id}: {recipe.name}, {where}; output {job.name}-{job_id}.out in {job.workdir}")
    return EXIT_OK


def _command(args) -> str:
    """The command that writes this script, for its header (what was asked, not how it was spelled)."""
    words = ["python", "-m", "plugin", "sbatch", args.recipe]
    for flag in ("partition", "time", "account", "save", "nodes", "gpus_per_node", "cpus_per_process"):
        value = getattr(args, flag)
        if value is not None:
            words += [f"--{flag.replace('_', '-')}", str(value)]
    words += ["--cpu"] if args.cpu else []
    words += ["--", *args.train_args] if args.train_args else []
    return shlex.join(words)
