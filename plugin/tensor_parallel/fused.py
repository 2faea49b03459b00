"""A column layer's matmul fused with the collective of its input, overlapping that collective in backward.

``column_linear(x, A_r, b_r, group, sequence_parallel)`` computes what ``F.linear`` after ``f`` (or, with
sequence parallelism, after the sequence all-gather) computes, with the same collectives, but in one
autograd node, so that backward can start the collective on ``dx`` and compute ``dA_r`` while it runs:

    forward   X = x (replicated)          or  X = [x_0 | ... | x_{p-1}] along dim 0 (all-gather)
              Y_r = X A_r^T + b_r
    backward  dX = dY_r A_r                           (this rank's partial input gradient)
              dx = sum_q dX_q (all-reduce, async)  or  dx = chunk_r(sum_q dX_q) (reduce-scatter, async)
              dA_r = dY_r^T X,  db_r = sum dY_r        (computed while the collective runs)

Megatron-LM overlaps the same way. ``X`` is kept for backward (under sequence parallelism that is the
gathered input: memory for one fewer all-gather, see :mod:`.layers`). ``dx`` is a fresh tensor, so the
collective works in place on it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import _all_gather_first, group_size


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _ColumnLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel):
        total = _all_gather_first(x, group) if sequence_parallel else x
        ctx.save_for_backward(total, weight)
        ctx.group, ctx.sequence_parallel, ctx.has_bias = group, sequence_parallel, bias is not None
        return torch.nn.functional.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        total, weight = ctx.saved_tensors
        if weight.dtype != dy.dtype:  # forward ran under autocast: redo its casts (autograd casts dx back)
            total, weight = total.to(dy.dtype), weight.to(dy.dtype)
        group = ctx.group
        handle, dx = None, None
        if ctx.needs_input_grad[0]:
            dx_full = dy.matmul(weight)
            if ctx.sequence_parallel:
                p = group_size(group)
                dx = dx_full.new_empty((dx_full.shape[0] // p,) + tuple(dx_full.shape[1:]))
                scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
                handle = scatter(dx, dx_full.contiguous(), group=group, async_op=True)
            else:
                dx = dx_full
                handle = dist.all_reduce(dx, group=group, async_op=True)
        dw = _flat(dy).t().matmul(_flat(total)) if ctx.needs_input_grad[1] else None
        db = _flat(dy).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if handle is not None:
            handle.wait()
        return dx, dw, db, None, None


def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group,
                  sequence_parallel: bool = False) -> torch.Tensor:
    """``Y_r = X A_r^T + b_r`` with ``X`` the whole input (see the module docstring for the math)."""
    if group_size(group) == 1:
        return torch.nn.functional.linear(x, weight, bias)
    return _ColumnLinear.apply(x, weight, bias, group, sequence_parallel)
