"""Checkpoints of the native back end through the checkpoint room (:mod:`plugin.checkpoint`): every tensor under
the unsharded model's name with its global shape, so a checkpoint of any layout loads into any other.

What a native rank holds: its pipeline stages' parameters (the whole model's own modules, so canonical names come
by identity), each a TP-local tensor (plain, or an FSDP2 DTensor whose local shard is a row range of it);
optimizer states from the local torch optimizer (ZeroRedundancyOptimizer: only the partition this rank owns;
nothing is consolidated; with an expert axis at ZeRO-1, both partitions' local optimizers).
"""
from __future__ import annotations

from ...checkpoint import adapt


def named_local_params(engine) -> dict:
    """``{canonical name: parameter}`` of the parameters this rank's container holds."""
    held = {id(p) for p in engine.container.parameters()}
    return {n: p for n, p in engine.whole_model.named_parameters() if id(p) in held}


def local_optimizer(engine):
    """The torch optimizer that steps this rank's states: a ZeroRedundancyOptimizer's own partition's; with an
    expert axis at ZeRO-1 (:class:`.optimizers.Optimizers`) the parts' local ones, read as one."""
    from .optimizers import Optimizers

    opt = engine.optimizer
    if isinstance(opt, Optimizers):
        return Optimizers([_local(o) for o in opt.parts])
    return _local(opt)


def _local(opt):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt  # its own partition, stepped locally


def save(engine, directory: str, client_state: dict | None = None, *, keep: int | None = None):
    return adapt.save(engine, directory, client_state, keep=keep)


def load(engine, directory: str) -> dict:
    return adapt.load(engine, directory)
