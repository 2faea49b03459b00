"""``python -m plugin`` (the ``parallel-recipe`` script): validate, show, export, import, estimate, plan, checkpoint,
plot, elastic, sbatch, dryrun.

Each command is a module in :mod:`plugin.cli` with ``register(subparsers)`` and ``run(args) -> int``.
None of them imports torch, deepspeed or accelerate: they answer in milliseconds (``checkpoint export`` and
``dryrun`` run a child).
Exit codes: 0 fine (warnings on stderr), 1 usage error, 2 invalid recipe, 3 it does not fit
(``estimate`` and ``plan``).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from .common import run_command

COMMANDS = ["validate", "show", "export", "import_", "estimate", "plan", "elastic", "checkpoint", "plot", "sbatch",
            "dryrun"]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, just that command's module is imported (quicker start for validate)."""
    parser = argparse.ArgumentParser(
        prog="python -m plugin",
        description="Validate, inspect, convert and plan parallel-training recipes.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        if only is None or name.rstrip("_") == only:
            importlib.import_module(f"plugin.cli.{name}").register(sub)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    first = argv[0] if argv else None
    if first and not first.startswith("-") and first not in {c.rstrip("_") for c in COMMANDS} and \
            (first.endswith((".json", ".yaml", ".yml")) or os.path.exists(first)):
        print(f"python -m plugin: {first!r} is not a command -> name one first: python -m plugin validate {first} "
              "(or show, estimate, export, import; --help lists them all)", file=sys.stderr)
        return 1
    tail = None
    if first == "sbatch" and "--" in argv:  # train.py's arguments, after --, passed on as they are
        argv, tail = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    parser = build_parser(first if first in {c.rstrip("_") for c in COMMANDS} else None)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on usage errors; 2 means "invalid recipe" here
        return 0 if e.code == 0 else 1
    if tail is not None:
        args.train_args = tail
    try:
        code = run_command(args)
        sys.stdout.flush()  # here, where a closed stdout can still be caught
        return code
    except BrokenPipeError:  # `... | head -1`: the reader has gone; end quietly (Python's recipe, signal docs)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's last flush then says nothing
        return 0
