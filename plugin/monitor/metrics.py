"""``train.py --metrics PATH``: one JSON line per step (pure: no torch).

Keys (:data:`.record.METRIC_KEYS`): ``step``, ``loss``, ``tokens_per_s``, ``lr``, ``grad_norm``, ``tokens``,
``step_time_s``, ``memory_gb``, ``mfu``, and ``eval_loss`` on evaluation steps. Rank 0 writes it; a PATH with
``{rank}`` in it makes every rank write its own (the loss, lr and norm are the same on every rank; step time and
tokens/s are each rank's). ``extra`` keys go into every record (``--resume auto``: ``restart``, the run's start
number, the start that trained each step).

A resumed run (``--resume``) continues the file as one timeline, like the checkpoint directory: the lines of the
steps after the checkpoint's (what the interrupted run logged past its last save, or a later run's) are dropped
first, and so is a line the interruption cut short, so the file holds each step once.
"""
from __future__ import annotations

import json
import os


class MetricsFile:
    """``resumed_at``: None starts the file afresh; a step number keeps the lines up to that step and appends."""

    def __init__(self, path: str, rank: int, *, resumed_at: int | None, extra: dict | None = None):
        path = path.replace("{rank}", str(rank))
        if resumed_at is not None and os.path.exists(path):
            _keep_up_to(path, resumed_at)
        self.file = open(path, "w" if resumed_at is None else "a", encoding="utf-8")
        self.extra = extra or {}

    def write(self, report, eval_loss: float | None = None) -> None:
        record = {**report.to_json(), **self.extra}
        if eval_loss is not None:
            record["eval_loss"] = eval_loss
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _keep_up_to(path: str, step: int) -> None:
    """Rewrite ``path`` with its whole lines of steps <= ``step`` only."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by the interruption
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line + "\n")
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(kept)


def read_metrics(path) -> list[dict]:
    """The records of a ``--metrics`` file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
