"""``python -m plugin dryrun RECIPE [--model M] [--world-size N] [--ranks LIST|all] [--verify] [--json]``: every
rank of the job built and stepped on the meta device, in one process (docs/dry-run.md).

It needs torch: it runs ``python -m plugin.dryrun`` in a child process, so this module stays pure.
Exit codes: 0 every check passed, 2 a check failed (the ranks named) or the recipe is refused, 1 usage error.
"""
from __future__ import annotations

import subprocess
import sys

from ..dryrun.args import HELP, add_arguments, to_argv


def register(subparsers) -> None:
    p = subparsers.add_parser("dryrun", help=HELP, description=HELP + ": coordinates, groups, parameters, bytes of "
                              "parameters, gradients and optimizer states next to the planner's estimate, and the "
                              "collectives of one training step, over a recording process group.",
                              epilog="Exit codes: 0 every check passed, 2 a check failed or the recipe is refused, "
                              "1 usage error.")
    add_arguments(p)
    p.set_defaults(run=run)


def run(args) -> int:
    return subprocess.run([sys.executable, "-m", "plugin.dryrun", *to_argv(args)]).returncode
