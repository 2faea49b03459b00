"""Shared output helpers of the estimate and plan commands: problems on stderr, rich tables on stdout.

rich is imported inside :func:`print_table` only, so ``--json`` and the error paths never load it.
"""
from __future__ import annotations

import json
import sys
from typing import Iterable, Sequence


def print_problems(problems: Iterable, stream=None) -> None:
    """Each problem on its own line (``FILE: $.path: what -> fix``)."""
    stream = stream or sys.stderr
    for p in problems:
        print(p.format() if hasattr(p, "format") else str(p), file=stream)


def print_json(data) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], *,
                right: Sequence[str] = (), caption: str = "") -> None:
    """A rich table; columns named in ``right`` are right-aligned (numbers)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left", caption=caption or None, caption_justify="left")
    for name in columns:
        table.add_column(name, justify="right" if name in right else "left", no_wrap=name in right)
    from rich.markup import escape

    for row in rows:
        table.add_row(*(escape(str(cell)) for cell in row))
    Console(width=max(100, _terminal_width())).print(table)


def _terminal_width() -> int:
    import shutil

    return shutil.get_terminal_size((120, 24)).columns
