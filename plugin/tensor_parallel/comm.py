"""Autograd collectives of tensor parallelism: Megatron's f and g, and their sequence-parallel forms.

Each function is named by what it does to the activations, and documented with its forward and backward
math. Notation: ``p`` ranks in the tensor group, ``r`` this rank's index, ``x_r`` the tensor on rank
``r``, ``dy_r`` the gradient arriving on rank ``r``, ``[a | b]`` concatenation, ``chunk_r(x)`` the r-th of
``p`` equal slices. "Tensor region" slices the last dimension (features, heads); "sequence region" slices
the first dimension, which is the sequence in the ``[seq, batch, hidden]`` layout the reference GPT uses
between blocks (the layout Megatron-LM uses, for the same reason: a slice of dim 0 is contiguous).

Every function takes its group explicitly. ``group=None`` or a group of one returns the input unchanged,
with no collective and no autograd node, so a model sharded over one rank costs nothing extra.

The collectives are called as ``torch.distributed.<name>`` at call time, so a benchmark (or a test) can
count them by wrapping those functions.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .errors import TensorParallelError

# ------------------------------------------------------------------ group helpers


def group_size(group) -> int:
    """Ranks in ``group``; ``None`` means "no tensor parallelism" (1), not the world group."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's index in ``group`` (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)


# ------------------------------------------------------------------ raw collectives (no autograd)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(x, group=group)
    return x


def _all_gather_first(x: torch.Tensor, group) -> torch.Tensor:
    """``[x_0 | x_1 | ...]`` along dim 0."""
    x = x.contiguous()
    out = x.new_empty((group_size(group) * x.shape[0],) + tuple(x.shape[1:]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)
    return out


def _reduce_scatter_first(x: torch.Tensor, group) -> torch.Tensor:
    """``chunk_r(sum_q x_q)`` along dim 0."""
    p = group_size(group)
    if x.shape[0] % p:
        raise TensorParallelError(
            f"sequence parallelism: the sequence dimension ({x.shape[0]}) is not divisible by the tensor "
            f"size ({p}); use a sequence length that is a multiple of {p}")
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // p,) + tuple(x.shape[1:]))
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, x, group=group)
    return out


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """``chunk_r(x)`` along ``dim`` (a contiguous copy, so later collectives can use it directly)."""
    p = group_size(group)
    if x.shape[dim] % p:
        where = "sequence" if dim == 0 else "last"
        raise TensorParallelError(
            f"cannot split the {where} dimension of size {x.shape[dim]} over {p} tensor ranks; "
            f"make it a multiple of {p}")
    return x.chunk(p, dim=dim)[group_rank(group)].contiguous()


def _all_gather_last(x: torch.Tensor, group) -> torch.Tensor:
    """``[x_0 | x_1 | ...]`` along the last dimension."""
    stacked = _all_gather_first(x.unsqueeze(0), group)  # [p, *x.shape]
    return torch.cat(stacked.unbind(0), dim=-1)


# ------------------------------------------------------------------ tensor region (Megatron's f and g)


class _CopyToTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        # Never reduce into autograd's buffer in place: it may be shared with another consumer.
        return _all_reduce(dy.clone(memory_format=torch.contiguous_format), ctx.group), None


class _ReduceFromTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        if x.grad_fn is not None and x.is_contiguous():
            ctx.mark_dirty(x)  # autograd raises if another node saved x: never a silent corruption
            return _all_reduce(x, group)
        return _all_reduce(x.clone(memory_format=torch.contiguous_format), group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _ScatterToTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, dy):
        return _all_gather_last(dy, ctx.group), None


class _GatherFromTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_last(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _split(dy, -1, ctx.group), None


def copy_to_tensor_region(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's ``f``: enter a tensor-parallel region with a replicated input.

    forward ``y_r = x`` (identity); backward ``dx = sum_q dy_q`` (all-reduce), because every rank's
    slice of the layer consumed the same ``x`` and each contributes a partial gradient.
    """
    return x if group_size(group) == 1 else _CopyToTensorRegion.apply(x, group)


def reduce_from_tensor_region(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's ``g``: leave a tensor-parallel region by summing partial results.

    forward ``y = sum_q x_q`` (all-reduce); backward ``dx_r = dy`` (identity: ``y`` is replicated, so
    ``dy`` is the same on every rank and each partial ``x_r`` enters the sum with weight one).
    The sum is done in place when ``x`` is an intermediate result (autograd checks that nothing saved it).
    """
    return x if group_size(group) == 1 else _ReduceFromTensorRegion.apply(x, group)


def scatter_to_tensor_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's slice of the last dimension of a replicated tensor.

    forward ``y_r = chunk_r(x)`` along the last dim; backward ``dx = [dy_0 | ... | dy_{p-1}]`` (all-gather).
    """
    return x if group_size(group) == 1 else _ScatterToTensorRegion.apply(x, group)


def gather_from_tensor_region(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's slice of the last dimension.

    forward ``y = [x_0 | ... | x_{p-1}]`` (all-gather); backward ``dx_r = chunk_r(dy)`` (``y`` is replicated,
    so each rank keeps the gradient of its own slice).
    """
    return x if group_size(group) == 1 else _GatherFromTensorRegion.apply(x, group)


# ------------------------------------------------------------------ sequence region (sequence parallelism)


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, 0, group)

    @staticmethod
    def backward(ctx, dy):
        return _all_gather_first(dy, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _all_gather_first(x, group)

    @staticmethod
    def backward(ctx, dy):
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_first(dy, ctx.group), None, None
        return _split(dy, 0, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _all_gather_first(dy, ctx.group), None


def scatter_to_sequence_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's slice of the sequence (dim 0) of a replicated tensor.

    forward ``y_r = chunk_r(x)`` along dim 0; backward ``dx = [dy_0 | ... | dy_{p-1}]`` along dim 0
    (all-gather), so ``dx`` is whole and the same on every rank.
    """
    return x if group_size(group) == 1 else _ScatterToSequenceRegion.apply(x, group)


def gather_from_sequence_region(x: torch.Tensor, group, tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """All-gather the sequence (dim 0): Megatron's ``g`` of sequence parallelism, before a column layer.

    forward ``y = [x_0 | ... | x_{p-1}]`` along dim 0 (all-gather).
    backward, when the consumer of ``y`` is tensor-parallel (each rank's ``dy_r`` is a partial sum):
    ``dx_r = chunk_r(sum_q dy_q)`` (reduce-scatter); when the consumer is replicated
    (``tensor_parallel_output_grad=False``, every ``dy_r`` is already whole): ``dx_r = chunk_r(dy)``.
    """
    if group_size(group) == 1:
        return x
    return _GatherFromSequenceRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group) -> torch.Tensor:
    """Sum partial results and keep this rank's slice of the sequence: ``g-bar``, after a row layer.

    forward ``y_r = chunk_r(sum_q x_q)`` along dim 0 (reduce-scatter); backward
    ``dx = [dy_0 | ... | dy_{p-1}]`` along dim 0 (all-gather): every rank's partial ``x_r`` fed every slice.
    """
    return x if group_size(group) == 1 else _ReduceScatterToSequenceRegion.apply(x, group)


# ------------------------------------------------------------------ replicated parameters under sequence parallelism


def _dense(grads, likes) -> list[torch.Tensor]:
    """The gradients, a zero of the input's shape where autograd produced none (every rank must contribute the
    same sizes to the collective)."""
    return [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, (shape, dtype, device) in zip(grads, likes, strict=True)]


class _AllReduceGradsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        ctx.likes = [(t.shape, t.dtype, t.device) for t in tensors]
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        # One all-reduce for all of them: flatten, sum over the group, cut back.
        dense = _dense(grads, ctx.likes)
        out: list = [None] * len(dense)
        for dtype in dict.fromkeys(g.dtype for g in dense):  # one all-reduce per dtype (usually one)
            idx = [i for i, g in enumerate(dense) if g.dtype == dtype]
            flat = _all_reduce(torch.cat([dense[i].reshape(-1) for i in idx]), ctx.group)
            offset = 0
            for i in idx:
                out[i] = flat[offset:offset + dense[i].numel()].view_as(dense[i])
                offset += dense[i].numel()
        return (None, *out)


def allreduce_grads_in_backward(tensors: Sequence[torch.Tensor], group) -> tuple[torch.Tensor, ...]:
    """Use replicated parameters in a sequence-sharded region: identity forward, summed gradients backward.

    Under sequence parallelism a norm weight (or a bias added after a reduce-scatter) is replicated but
    sees only this rank's ``1/p`` of the tokens, so its gradient on rank ``r`` is a partial sum.
    forward ``y_i = t_i`` for each tensor; backward ``dt_i = sum_q dy_{i,q}``, with one all-reduce for the
    whole list. The result is every rank holding the full, identical gradient, inside autograd, whatever
    engine (ZeRO, pipeline, gradient accumulation) consumes it afterwards. Megatron-LM instead sums such
    gradients once per step after backward; that would come too late for engines that reduce gradients
    from hooks during backward (DeepSpeed ZeRO-2/3), so the plugin pays one small all-reduce per call.
    """
    tensors = tuple(tensors)
    if group_size(group) == 1 or not tensors:
        return tensors
    return _AllReduceGradsInBackward.apply(group, *tensors)


class _SumGradsOverReplicas(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, replicas, *tensors):
        ctx.group, ctx.replicas = group, replicas
        ctx.likes = [(t.shape, t.dtype, t.device) for t in tensors]
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        dense = _dense(grads, ctx.likes)
        flat = torch.cat([g.reshape(-1) for g in dense])  # one module's weight and bias: one dtype
        slot = group_rank(ctx.group) // ctx.replicas
        slots = flat.new_zeros((group_size(ctx.group) // ctx.replicas, flat.numel()))
        slots[slot] = flat
        mine = _all_reduce(slots, ctx.group)[slot]
        out, offset = [], 0
        for g in dense:
            out.append(mine[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return (None, None, *out)


def sum_grads_over_replicas(tensors: Sequence[torch.Tensor], group, replicas: int) -> tuple[torch.Tensor, ...]:
    """Use parameters whose slice ``replicas`` consecutive ranks of ``group`` hold alike (a key/value head replicated
    over the ranks whose query heads read it): identity forward, gradients summed over those ranks backward.

    Rank ``r`` holds slice ``s = r // replicas`` and computes only its own query heads' part of its gradient.
    forward ``y_i = t_i``; backward ``dt_i = sum_{q // replicas = s} dy_{i,q}``, the whole gradient of slice ``s``
    on each of its holders, inside autograd (engines that reduce from hooks see it summed once). One all-reduce
    over ``group`` of ``[p / replicas, n]`` slots, each rank's gradient in its slice's slot (no subgroup to build).
    The input's gradient needs nothing more: each rank's part of it comes from its own query heads, and ``f`` sums
    those over the group as for any column layer.
    """
    tensors = tuple(tensors)
    if group_size(group) == 1 or replicas == 1 or not tensors:
        return tensors
    return _SumGradsOverReplicas.apply(group, replicas, *tensors)


__all__ = [
    "group_size", "group_rank",
    "copy_to_tensor_region", "reduce_from_tensor_region", "scatter_to_tensor_region", "gather_from_tensor_region",
    "scatter_to_sequence_region", "gather_from_sequence_region", "reduce_scatter_to_sequence_region",
    "allreduce_grads_in_backward", "sum_grads_over_replicas",
]
