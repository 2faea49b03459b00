"""Whole tensors back from tensor-parallel shards: for checkpoints, and to compare against an unsharded model.

A parameter split by :mod:`.sharding` carries ``partition_dim``, ``partition_stride`` (packed parts),
``partition_padding`` and ``partition_replicas``; :func:`full_tensor` all-gathers a shard (the parameter itself,
its gradient, or an optimizer state of its shape) and undoes the split. Replicated parameters come back as they are.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .comm import group_size
from .sharding import is_sharded, unshard


def full_tensor(shard: torch.Tensor, param: torch.Tensor, tp_group) -> torch.Tensor:
    """The whole tensor of which ``shard`` is this rank's slice, split like ``param`` (a collective:
    every rank of ``tp_group`` must call it). For a replicated ``param``, ``shard`` itself."""
    p = group_size(tp_group)
    if not is_sharded(param) or p == 1:
        return shard
    pieces = [torch.empty_like(shard) for _ in range(p)]
    dist.all_gather(pieces, shard.contiguous(), group=tp_group)
    return unshard(pieces, param.partition_dim, parts=param.partition_stride, padding=param.partition_padding,
                   replicas=getattr(param, "partition_replicas", 1))


def full_state_dict(model: nn.Module, tp_group, *, grads: bool = False) -> dict[str, torch.Tensor | None]:
    """``{parameter name: whole tensor}`` (or whole gradients with ``grads=True``; ``None`` where a
    parameter has no gradient). A collective over ``tp_group``; tied parameters appear under each name."""
    out: dict[str, torch.Tensor | None] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        t = param.grad if grads else param.detach()
        if t is None:
            out[name] = None  # every rank skips alike: gradients exist or not on all tensor ranks together
            continue
        out[name] = full_tensor(t, param, tp_group)
    return out
