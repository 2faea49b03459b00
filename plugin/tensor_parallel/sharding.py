"""Which slice of a whole tensor each tensor-parallel rank holds, and how to put the slices back together.

Pure tensor arithmetic (no process group). A dimension of size ``n`` split over ``p`` ranks:

* plain: ``n % p == 0``; rank ``r`` holds ``[r*n/p, (r+1)*n/p)``.
* padded (vocabularies): ``n`` is first padded with zero rows to ``padded_size(n, p)``, the next multiple of
  ``p``; the padding lands at the end, so only the last rank(s) hold padded rows.
* packed (``parts = k > 1``, e.g. GPT-2's fused ``[q | k | v]``): the dimension is ``k`` equal parts laid end
  to end, and each part is split on its own, so rank ``r`` holds ``[part_0[r] | part_1[r] | ...]``.

* replicated (``replicas = k > 1``, key/value heads fewer than the ranks): the dimension is split over
  ``p / k`` slices, and ``k`` consecutive ranks hold the same slice (rank ``r`` holds slice ``r // k``).

Sharded parameters carry Megatron's attributes (``tensor_model_parallel``, ``partition_dim``,
``partition_stride``), which is also what DeepSpeed's ``is_model_parallel_parameter`` reads, plus
``partition_padding`` (rows of padding in the gathered tensor) and ``partition_replicas`` (ranks holding each
slice) so :func:`unshard` can undo the split.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def padded_size(n: int, tp_size: int) -> int:
    """``n`` rounded up to a multiple of ``tp_size`` (``n`` itself when it already divides)."""
    if n < 1 or tp_size < 1:
        raise ValueError(f"padded_size needs n >= 1 and tp_size >= 1, got n={n}, tp_size={tp_size}")
    return -(-n // tp_size) * tp_size


def shard_range(n: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``tp_rank``'s slice of a (padded) dimension of size ``n``."""
    assert n % tp_size == 0 and 0 <= tp_rank < tp_size, (n, tp_size, tp_rank)
    per = n // tp_size
    return tp_rank * per, (tp_rank + 1) * per


def shard(full: torch.Tensor, dim: int, tp_size: int, tp_rank: int, *, parts: int = 1,
          pad: bool = False) -> torch.Tensor:
    """Rank ``tp_rank``'s slice of ``full`` along ``dim``, as a new contiguous tensor (never a view).

    ``pad=True`` pads ``dim`` with zeros to :func:`padded_size` first; otherwise the size must divide
    (``parts * tp_size``). A copy is returned so the whole tensor can be freed once every shard is cut.
    """
    n = full.shape[dim]
    if pad:
        assert parts == 1, "padding and packed parts do not mix"
        target = padded_size(n, tp_size)
        if target != n:
            shape = list(full.shape)
            shape[dim] = target - n
            full = torch.cat([full, full.new_zeros(shape)], dim=dim)
        n = target
    assert n % (parts * tp_size) == 0, (n, parts, tp_size)
    pieces = full.chunk(parts, dim=dim)
    mine = [p.chunk(tp_size, dim=dim)[tp_rank] for p in pieces]
    if parts > 1:
        return torch.cat(mine, dim=dim)  # a new tensor already
    return mine[0].clone(memory_format=torch.contiguous_format)


def unshard(shards: Sequence[torch.Tensor], dim: int, *, parts: int = 1, padding: int = 0,
            replicas: int = 1) -> torch.Tensor:
    """The whole tensor from every rank's shard (in rank order): undoes :func:`shard` (``replicas``: ranks holding
    each slice, the first of them taken)."""
    shards = list(shards)[::replicas]
    if parts == 1:
        full = torch.cat(list(shards), dim=dim)
    else:
        split = [s.chunk(parts, dim=dim) for s in shards]
        full = torch.cat([split[r][k] for k in range(parts) for r in range(len(shards))], dim=dim)
    if padding:
        full = full.narrow(dim, 0, full.shape[dim] - padding)
    return full


def mark_sharded(param: torch.Tensor, dim: int, *, parts: int = 1, padding: int = 0, replicas: int = 1,
                 first: bool = True) -> torch.Tensor:
    """Tag ``param`` as split across the tensor group (Megatron's and DeepSpeed's attribute names).

    DeepSpeed and the plugin's clipping count a ``tensor_model_parallel`` parameter's gradient norm on every
    tensor rank (each holds a different slice) and any other on tensor rank 0 only, so clipping sees each number
    exactly once. A slice held by ``replicas`` ranks is therefore ``tensor_model_parallel`` on the ``first`` of
    them only: on the others it is Megatron's "tensor-parallel duplicate", never counted (none is tensor rank 0).
    """
    param.tensor_model_parallel = first
    param.partition_dim = dim
    param.partition_stride = parts
    param.partition_padding = padding
    param.partition_replicas = replicas
    return param


def is_sharded(param: torch.Tensor) -> bool:
    """True for a parameter that :func:`mark_sharded` tagged (a duplicate of a replicated slice too)."""
    return bool(getattr(param, "tensor_model_parallel", False)) or getattr(param, "partition_replicas", 1) > 1
