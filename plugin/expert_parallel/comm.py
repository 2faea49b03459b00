"""Autograd collectives of expert parallelism: the uneven all-to-all that carries tokens to their experts' ranks and
back, the exchange of token counts that sizes it, and the sum over ranks of the load-balancing statistics.

Notation: ``p`` ranks in the expert group, ``x_r`` the tensor on rank ``r``, ``s_r[j]`` the rows rank ``r`` sends to
rank ``j`` (its ``send`` splits; ``recv`` on rank ``j`` holds ``s_r[j]`` at place ``r``), ``dy`` the gradient arriving.
Every function takes its group explicitly; ``None`` or a group of one returns the input unchanged, with no collective
and no autograd node. The collectives are called as ``torch.distributed.<name>`` at call time, so a test can wrap
them.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def group_size(group) -> int:
    """Ranks in ``group``; ``None`` means no expert parallelism (1)."""
    return 1 if group is None else dist.get_world_size(group)


def _all_to_all(x: torch.Tensor, send: Sequence[int], recv: Sequence[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(recv), input_split_sizes=list(send),
                           group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """forward: rank j gets ``[x_0 rows for j | x_1 rows for j | ...]``; backward: ``dy`` sent back the same way with
    the splits swapped (each row's gradient returns to the rank it came from)."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, dy):
        return _all_to_all(dy, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send: Sequence[int], recv: Sequence[int], group) -> torch.Tensor:
    """Rows of ``x`` (``send[j]`` of them, in order, for rank ``j``) to their ranks; returns the ``sum(recv)`` rows
    received, grouped by source rank. Forward all-to-all(send, recv) / backward all-to-all(recv, send)."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, tuple(int(n) for n in send), tuple(int(n) for n in recv), group)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """``counts [p, L]`` (tokens this rank sends to each local expert of each rank) -> ``[p, L]``: row ``r`` the
    tokens rank ``r`` sends to each of this rank's experts. No autograd (integers)."""
    if group_size(group) == 1:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


class _SumOverRanks(torch.autograd.Function):
    """forward: ``y = sum_r x_r`` on every rank; backward: ``dx_r = sum_j dy_j`` (every rank's copy of ``y`` feeds a
    loss whose gradient the data group averages: the sum gives each rank's ``x_r`` its whole gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, dy):
        dx = dy.clone()
        dist.all_reduce(dx, group=ctx.group)
        return dx, None


def sum_over_ranks(x: torch.Tensor, group) -> torch.Tensor:
    """``sum_r x_r`` on every rank of ``group``, with autograd. Forward all-reduce / backward all-reduce."""
    if group_size(group) == 1:
        return x
    return _SumOverRanks.apply(x, group)
