"""Reading train.py's own options out of the arguments a door passes on to it (pure)."""
from __future__ import annotations


def train_option(args: list[str], name: str) -> str | None:
    """The value of ``name VALUE`` (or ``name=VALUE``) among ``args``, else None.

    >>> train_option(["--steps", "5", "--save=ck"], "--save"), train_option(["--save"], "--save")
    ('ck', None)
    """
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg[len(name) + 1:]
    return None
