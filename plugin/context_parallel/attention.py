"""What a model's attention is told under context parallelism, and the one call it makes.

:class:`ContextParallelContext` is this rank's context group, its size and index, the recipe's method and the
rank's dropout stream; :func:`context_attention` is SDPA's contract (``q [b, heads, s, d]``, keys and values with
``kv_heads``, causal) over a sequence split across that group, by ring or by all-to-all (:mod:`.ring`,
:mod:`.ulysses`). The dropout stream is a :class:`plugin.tensor_parallel.random.TensorParallelRNG` of its own per
(tensor, context) rank, seeded ``seed + 100 x pp_rank + 2718 + 1024 + tp_size x cp_rank + tp_rank`` (the tensor-parallel
stream's scheme, offset by 1024 as Megatron offsets its expert stream): queries of different chunks and heads draw
independent masks. The model holds the context as ``.cp``, where checkpoints and activation checkpointing find the
stream (:func:`plugin.tensor_parallel.random.tensor_parallel_rngs`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..tensor_parallel.random import TensorParallelRNG, sharded_region
from .chunks import local_positions
from .errors import ContextParallelError

METHODS = ("ring", "all_to_all")
CONTEXT_SEED_OFFSET = 1024


def context_rng(seed: int, tp_rank: int, tp_size: int, cp_rank: int, pp_rank: int = 0) -> TensorParallelRNG:
    """The dropout stream of one (tensor, context) rank: see the module docstring."""
    return TensorParallelRNG(seed + CONTEXT_SEED_OFFSET, tp_rank + tp_size * cp_rank, pp_rank)


@dataclass(frozen=True, eq=False)
class ContextParallelContext:
    """This rank's context group (``size`` ranks, this one ``rank``), the method and the dropout stream."""

    group: Any
    size: int
    rank: int
    method: str = "ring"
    rng: TensorParallelRNG | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ContextParallelError(f"context_parallel.method {self.method!r} -> use one of {list(METHODS)}")

    def positions(self, local_len: int, device=None) -> torch.Tensor:
        """The global positions of this rank's ``local_len`` tokens (its two chunks)."""
        return local_positions(self.rank, self.size, local_len * self.size, device)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallelContext, *,
                      causal: bool = True, key_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                      scale: float | None = None) -> torch.Tensor:
    """``softmax(q k^T scale + causal + key mask) v`` with dropout, over the whole sequence, for this rank's queries
    ``q [b, heads, 2n, d]`` and keys/values ``[b, kv_heads, 2n, d]`` (its chunks). ``key_mask [b, S]``: the whole
    sequence's, True where a key may be attended. The recipe's method computes it; dropout draws from ``cp.rng``."""
    from .ring import ring_attention
    from .ulysses import all_to_all_attention

    if q.shape[2] % 2:
        raise ContextParallelError(f"context attention got {q.shape[2]} tokens on this rank: it holds two equal chunks "
                                   "of the sequence -> cut the batch with plugin.context_parallel.batch")
    attend = ring_attention if cp.method == "ring" else all_to_all_attention
    with sharded_region(cp.rng if dropout_p else None, q.device):
        return attend(q, k, v, cp.group, causal=causal, key_mask=key_mask, dropout_p=dropout_p, scale=scale)
