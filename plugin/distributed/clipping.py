"""Gradient clipping by the global norm of a model sharded three ways, as DeepSpeed computes it.

The norm is the 2-norm of the whole model's gradient, as one process would compute it, whatever the layout:

* tensor-sharded parameters (``tensor_model_parallel``: each tensor rank holds a different slice) count on
  every tensor rank; replicated ones (norms, biases after a row layer, everything at tensor 1) count
  once per tensor group, on tensor rank 0, exactly like DeepSpeed's ``clip_grad_norm_`` with an mpu;
* every pipeline stage holds different layers, so the sums of squares are added over the pipeline group
  (the model group is tensor x pipeline: one all-reduce covers both);
* with an expert axis each expert rank holds other experts: their sums of squares are added over the expert group
  (then over tensor x pipeline with the rest), so that every expert counts once;
* FSDP2 shards (DTensor gradients) and the native ZeRO-2's row shards (plain tensors, ``data_sharded``) hold a
  piece of each gradient per data rank: their sums of squares are added over the data group first. DDP / ZeRO-1
  gradients are already averaged and whole on every data rank: they are not.

Then ``clip_coef = max_norm / (norm + 1e-6)``, applied when below 1 (torch's ``clip_grads_with_norm_``,
the same formula as DeepSpeed's). Sequence-parallel norm weights already carry their summed gradient
(the autograd all-reduce in the GPT's blocks), so they are replicated parameters like any other.
Groups are passed in; nothing here is global.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.nn.utils import clip_grads_with_norm_, get_total_norm


def _local(grad: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(this rank's piece of ``grad``, whether it is an FSDP shard of a larger gradient)."""
    to_local = getattr(grad, "to_local", None)
    if to_local is not None:  # a DTensor: FSDP2's Shard(0) over the data mesh
        return to_local(), True
    return grad, False


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    return get_total_norm([t.float() for t in tensors]).to(device).square()


def global_grad_norm(params: Iterable[torch.nn.Parameter], *, tensor_sharded: set, tp_rank: int,
                     model_group=None, model_size: int = 1, data_group=None, data_sharded: bool = False,
                     device: torch.device | None = None, skip: frozenset = frozenset(), expert: set = frozenset(),
                     expert_group=None) -> torch.Tensor:
    """The global 2-norm of the gradients of ``params`` (this rank's parameters), the same on every rank.

    ``tensor_sharded``: ids of the parameters sharded by tensor parallelism. ``model_group`` (size
    ``model_size``): tensor x pipeline peers. ``data_group`` with ``data_sharded=True``: the data group over which
    every gradient is split (FSDP2's DTensors, ZeRO-2's row shards; a collective every data rank must join).
    ``skip``: ids of parameters counted on another rank (a weight tied across pipeline stages counts on its first
    holder only). ``expert``: ids of the parameters of this rank's experts, which differ across ``expert_group`` (the
    expert ranks): their sums of squares are added over it first, so that every expert counts once.
    """
    whole, pieces, experts = [], [], []
    for p in params:
        # a replicated parameter is the same on every tensor rank: count it once, on tensor rank 0 (as DeepSpeed does)
        if p.grad is None or id(p) in skip or (tp_rank != 0 and id(p) not in tensor_sharded):
            continue
        local, is_piece = _local(p.grad.detach())
        if id(p) in expert and not (is_piece or data_sharded):
            experts.append(local)
            continue
        (pieces if is_piece or data_sharded else whole).append(local)
    device = device or torch.device("cpu")
    total = _sum_of_squares(whole, device)
    if expert_group is not None:
        expert_sq = _sum_of_squares(experts, device)
        dist.all_reduce(expert_sq, group=expert_group)
        total = total + expert_sq
    elif experts:
        total = total + _sum_of_squares(experts, device)
    if data_sharded:
        shard_sq = _sum_of_squares(pieces, device)
        if data_group is not None:
            dist.all_reduce(shard_sq, group=data_group)
        total = total + shard_sq
    elif pieces:
        raise AssertionError("DTensor gradients without data_sharded=True: their norm would miss the other shards")
    if model_size > 1:
        dist.all_reduce(total, group=model_group)
    return total.sqrt()


def clip_by_global_norm(params: list[torch.nn.Parameter], max_norm: float, **norm_args) -> torch.Tensor:
    """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))``; returns the global norm before clipping.

    ``max_norm <= 0`` only measures (DeepSpeed's ``gradient_clipping: 0`` means no clipping).
    """
    norm = global_grad_norm(params, **norm_args)
    if max_norm > 0:
        # one call per DTensor mesh: torch's foreach kernels refuse DTensors of two meshes in one list (FSDP2's
        # experts over the expert-data group, the rest over data x context)
        by_mesh: dict[int, list] = {}
        for p in params:
            if p.grad is not None:
                by_mesh.setdefault(id(getattr(p.grad, "device_mesh", None)), []).append(p)
        for grads in by_mesh.values():
            clip_grads_with_norm_(grads, max_norm, norm.to(grads[0].grad.device))
    return norm
