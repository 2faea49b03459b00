"""What the commands share: argument types, problems on stderr, JSON and rich tables on stdout, exit codes.

rich is imported inside :func:`console` only, so ``--json`` and the error paths never load it.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..errors import Problem, RecipeError

EXIT_OK, EXIT_USAGE, EXIT_INVALID = 0, 1, 2


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def size(text: str) -> float:
    """An argparse type for memory sizes: ``80GB``, ``80GiB`` or ``80`` (GB)."""
    from ..planning.units import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_world_size(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=positive_int, metavar="N",
                        help="processes the launcher will start (checked against the recipe; fills \"data\": \"auto\")")


def print_problems(problems: Iterable[Problem], stream=None) -> None:
    """Each problem on its own line (``FILE: $.path: what -> fix``)."""
    stream = stream or sys.stderr
    for p in problems:
        print(p.format(), file=stream)


def print_json(data) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def console(width: int):
    """A rich console on stdout at least ``width`` columns wide. A reader that has gone (``| head -1``) raises
    :class:`BrokenPipeError` to ``python -m plugin``'s main, which ends with exit 0; rich's own console would exit 1
    (its ``on_broken_pipe``)."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True  # nothing more to write: the reader has gone
            raise BrokenPipeError("stdout closed by its reader")

    return _Console(width=width)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], *,
                right: Sequence[str] = (), caption: str = "") -> None:
    """A rich table; columns named in ``right`` are right-aligned (numbers)."""
    import shutil

    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title, title_justify="left", caption=caption or None, caption_justify="left")
    for name in columns:
        table.add_column(name, justify="right" if name in right else "left", no_wrap=name in right)
    for row in rows:
        table.add_row(*(escape(str(cell)) for cell in row))
    console(max(100, shutil.get_terminal_size((120, 24)).columns)).print(table)


def run_command(args) -> int:
    """Run a parsed command; a :class:`RecipeError` it lets escape is printed as its problems (exit 2),
    never as a traceback. ``python -m plugin``'s main calls every command through this."""
    try:
        return int(args.run(args) or 0)
    except RecipeError as e:
        print_problems(e.problems)
        return EXIT_INVALID


def cannot_read(path: str, error: OSError, expected: str) -> str:
    """One line for a file argument that cannot be read: a directory, a missing file, or the system's reason;
    ``expected`` names what the command reads (``"a train.py --metrics file"``)."""
    if Path(path).is_dir():
        return f"{path}: a directory, not {expected} -> give the file itself"
    if not Path(path).exists():
        return f"{path}: no such file -> check the path; give {expected}"
    return f"{path}: cannot read: {error.strerror or error} -> check the file's permissions"


def needs_world_size(recipe, world_size, why: str) -> bool:
    """True (after saying so on stderr) when ``recipe`` has ``"data": "auto"`` and no world size was given."""
    if recipe.parallelism.data != "auto" or world_size is not None:
        return False
    print_problems([Problem("$.parallelism.data", f'"auto" takes the data size from the world size, and {why}',
                            "pass --world-size N (the number of processes the launcher will start)",
                            file=recipe.source)])
    return True


def load_or_report(ref: str, world_size):
    """The valid recipe, or None after printing its problems to stderr."""
    from ..recipe.checks import validate

    recipe, problems = validate(ref, world_size)
    print_problems(problems)
    return recipe
