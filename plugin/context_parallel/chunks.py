"""Where each context rank's tokens lie in the sequence: the load-balanced cut of Megatron and the ring papers.

The sequence of ``S`` tokens is cut into ``2 x C`` equal chunks; context rank ``i`` of ``C`` holds chunks ``i`` and
``2C - 1 - i``, in that order. Under a causal mask the first chunks attend to few keys and the last to many, so
each rank then does the same work: rank 0 of 2 holds chunks 0 and 3, rank 1 chunks 1 and 2::

    >>> chunk_ids(0, 2), chunk_ids(1, 2)
    ((0, 3), (1, 2))
    >>> local_positions(1, 2, 8).tolist()
    [2, 3, 4, 5]
    >>> local_positions(0, 2, 8).tolist()
    [0, 1, 6, 7]

All-gathering every rank's ``2S/2C`` tokens (rank order) gives the chunks in the order 0, 2C-1, 1, 2C-2, ...;
:func:`natural_order` is the permutation that sorts them back. Pure tensor arithmetic, no collective.
"""
from __future__ import annotations

import torch

from .errors import ContextParallelError


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of ``2 x cp_size``) context rank ``cp_rank`` holds: ``(cp_rank, 2 cp_size - 1 - cp_rank)``."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def chunk_len(seq_len: int, cp_size: int) -> int:
    """Tokens per chunk; the sequence must cut into ``2 x cp_size`` equal chunks (the recipe checks say so first)."""
    if seq_len % (2 * cp_size):
        raise ContextParallelError(f"context parallelism cuts the sequence into 2 x context {cp_size} equal chunks, "
                                   f"but it has {seq_len} tokens -> pad or pack the batch to a multiple of "
                                   f"{2 * cp_size} tokens (the recipe's seq_len)")
    return seq_len // (2 * cp_size)


def local_positions(cp_rank: int, cp_size: int, seq_len: int, device=None) -> torch.Tensor:
    """The global positions (int64, ``[seq_len / cp_size]``) of context rank ``cp_rank``'s tokens, in its order."""
    n = chunk_len(seq_len, cp_size)
    return torch.cat([torch.arange(c * n, (c + 1) * n, device=device) for c in chunk_ids(cp_rank, cp_size)])


def take_chunks(x: torch.Tensor, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """This rank's two chunks of ``x`` along ``dim`` (the whole sequence there), contiguous."""
    n = chunk_len(x.shape[dim], cp_size)
    parts = [x.narrow(dim, c * n, n) for c in chunk_ids(cp_rank, cp_size)]
    return torch.cat(parts, dim=dim).contiguous()


def natural_order(cp_size: int, chunk: int, device=None) -> torch.Tensor:
    """Indices that put the rank-order concatenation of every rank's tokens (``2 x chunk`` each) back in sequence
    order: ``gathered.index_select(dim, natural_order(...))`` is the whole sequence.

    >>> natural_order(2, 1).tolist()  # gathered chunks 0, 3, 1, 2
    [0, 2, 3, 1]
    """
    where = torch.empty(2 * cp_size, dtype=torch.int64)
    for r in range(cp_size):
        for j, c in enumerate(chunk_ids(r, cp_size)):
            where[c] = 2 * r + j
    index = (where[:, None] * chunk + torch.arange(chunk)[None, :]).reshape(-1)
    return index.to(device) if device is not None else index
