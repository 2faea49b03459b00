"""``train.py --metrics PATH``: one JSON line per step (pure: no torch).

Keys (:data:`.record.METRIC_KEYS`): ``step``, ``loss``, ``tokens_per_s``, ``lr``, ``grad_norm``, ``tokens``,
``step_time_s``, ``memory_gb``, ``mfu``, and ``eval_loss`` on evaluation steps. Rank 0 writes it; a PATH with
``{rank}`` in it makes every rank write its own (the loss, lr and norm are the same on every rank; step time and
tokens/s are each rank's). ``extra`` keys go into every record (``--resume auto``: ``restart``, the run's start
number, so that steps trained again after a restart are told apart).
"""
from __future__ import annotations

import json


class MetricsFile:
    def __init__(self, path: str, rank: int, *, append: bool, extra: dict | None = None):
        self.file = open(path.replace("{rank}", str(rank)), "a" if append else "w", encoding="utf-8")
        self.extra = extra or {}

    def write(self, report, eval_loss: float | None = None) -> None:
        record = {**report.to_json(), **self.extra}
        if eval_loss is not None:
            record["eval_loss"] = eval_loss
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def read_metrics(path) -> list[dict]:
    """The records of a ``--metrics`` file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
