"""Splitting a batch the way every back end does: this data rank's share of a global batch, then micro-batches.

A batch is a tensor or a tuple (list) of tensors, split along the first dimension; the shares are contiguous, so
data rank ``d`` of ``D`` trains on rows ``[d * rows / D, (d + 1) * rows / D)`` (the cut the step loader makes too,
:mod:`plugin.data.loader`).
"""
from __future__ import annotations


def shard_rows(batch, dp_rank: int, dp_size: int):
    """This data rank's contiguous share of a global batch (a tensor or a tuple of tensors)."""
    if isinstance(batch, (tuple, list)):
        return type(batch)(shard_rows(b, dp_rank, dp_size) for b in batch)
    rows = batch.shape[0]
    if rows % dp_size:
        raise ValueError(f"a global batch of {rows} rows does not split over {dp_size} data-parallel ranks")
    share = rows // dp_size
    return batch[dp_rank * share:(dp_rank + 1) * share]


def micro_batches(batch, count: int):
    """Split a (tuple of) tensor(s) into ``count`` equal micro-batches along the first dim."""
    if isinstance(batch, (tuple, list)):
        parts = [micro_batches(b, count) for b in batch]
        return [type(batch)(p[i] for p in parts) for i in range(count)]
    if batch.shape[0] % count:
        raise ValueError(f"{batch.shape[0]} rows do not split into {count} micro-batches")
    return list(batch.chunk(count))
