"""What the commands share: arguments, problem printing, exit codes."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Iterable

from ..errors import Problem

EXIT_OK, EXIT_USAGE, EXIT_INVALID = 0, 1, 2


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def add_world_size(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=positive_int, metavar="N",
                        help="processes the launcher will start (checked against the recipe; fills \"data\": \"auto\")")


def print_problems(problems: Iterable[Problem], stream=None) -> None:
    stream = stream or sys.stderr
    for p in problems:
        print(p.format(), file=stream)


def dump_json(data) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def load_or_report(ref: str, world_size):
    """The valid recipe, or None after printing its problems to stderr."""
    from ..checks import validate

    recipe, problems = validate(ref, world_size)
    print_problems(problems)
    return recipe
