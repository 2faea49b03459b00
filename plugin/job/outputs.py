"""The files a job writes beside its checkpoints, made ready before any process group (pure: no torch).

``--metrics PATH`` may name a directory that does not exist yet (``runs/tp2/metrics.jsonl``): the rank that writes
the file makes it first, as ``--save`` and ``--tensorboard`` make theirs, so that no rank raises a
``FileNotFoundError`` once every rank has started; a path that cannot be a file (a directory, a file where the
directory should be, no permission) is refused with what to change, before any process group.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


def metrics_problem(path: str, environ: Mapping[str, str]) -> str | None:
    """On the rank that writes ``--metrics path`` (rank 0, or every rank with ``{rank}`` in it: the launcher's
    ``RANK``), make the file's directory, or say why the file cannot be written there (None: it can)."""
    rank = environ.get("RANK", "0")
    if rank != "0" and "{rank}" not in path:
        return None
    file = Path(path.replace("{rank}", rank))
    if file.is_dir():
        return f"--metrics {path}: {file} is a directory -> give a file in it, e.g. {file / 'metrics.jsonl'}"
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return (f"--metrics {path}: cannot make its directory {file.parent} ({e.strerror or e}) -> give a path in a "
                "directory you can write")
    return None
