"""What a model learns when it is sharded: handed to ``model.configure_tensor_parallel(ctx)``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .random import TensorParallelRNG


@dataclass(frozen=True, eq=False)
class TensorParallelContext:
    """The tensor group of this rank, its size and index, the sequence-parallel switch, the dropout stream.

    ``rng.fork(device)`` is the random stream for dropout inside sharded regions (see :mod:`.random`).
    """

    group: Any
    size: int
    rank: int
    sequence_parallel: bool = False
    rng: TensorParallelRNG | None = None
