"""Weights tied across pipeline stages on the native back end: one copy per holding rank, kept equal.

Megatron's embedding group, for any tie :func:`plugin.pipeline_parallel.checks.ties_across_stages` finds (the
reference GPT's ``tie_embeddings``, GPT-2's ``tie_word_embeddings``: the first and the last stage):

* at build, after materialising, each copy is broadcast from the first holding stage's rank of its group (under
  meta init both copies were already filled by the same unit's init; an eager model whole on every rank is equal
  too: the broadcast makes it so whatever the caller did);
* after the schedule's backward (DDP has averaged each copy's gradient over the data group), the copies' gradients
  are summed over the group: each stage's copy then holds the gradient one process computes for the one tensor;
* the gradient norm counts the first holder's copy only (:attr:`TiedCopies.replicas`), as DeepSpeed skips its
  ``ds_pipe_replicated`` copies; clipping scales every copy alike, so the copies stay bitwise equal.

The groups come from :func:`plugin.distributed.groups.build_tie_groups`, one per (data, tensor) coordinate.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ...distributed.groups import build_tie_groups


class TiedCopies:
    """This rank's copies of weights tied across stages: ``(parameter, group, source rank, first holder)``."""

    def __init__(self, copies: list[tuple[nn.Parameter, object, int, bool]]):
        self.copies = copies

    @classmethod
    def build(cls, ties: Sequence, layers: Sequence[nn.Module], held_layers: set[int], groups, pipeline: int,
              timeout=None):
        """A collective: every rank calls it with the same ``ties`` (it builds their groups). ``held_layers``: the
        indices of the layers on this rank's stages; ``layers``: the (sharded, materialised) layer list; ``timeout``:
        the groups' (:func:`plugin.distributed.groups.build_tie_groups`)."""
        if not ties:
            return cls([])
        made = build_tie_groups(groups.topology, [tie.ranks(pipeline) for tie in ties], timeout=timeout)
        copies = []
        for tie in ties:
            ranks = tie.ranks(pipeline)
            mine = [(i, n) for i, n in zip(tie.layers, tie.names, strict=True) if i in held_layers]
            if groups.pp_rank not in ranks or not mine:
                continue
            i, name = mine[0]
            src = groups.topology.rank(pp=ranks[0], dp=groups.dp_rank, tp=groups.tp_rank, cp=groups.cp_rank)
            copies.append((layers[i].get_parameter(name), made[ranks], src, groups.pp_rank == ranks[0]))
        return cls(copies)

    @property
    def replicas(self) -> frozenset[int]:
        """Ids of the copies the gradient norm must not count (they equal the first holder's)."""
        return frozenset(id(p) for p, _, _, first in self.copies if not first)

    @torch.no_grad()
    def broadcast_values(self) -> None:
        for p, group, src, _ in self.copies:
            dist.broadcast(p.data, src=src, group=group)

    @torch.no_grad()
    def sum_grads(self) -> None:
        for p, group, _, _ in self.copies:
            if p.grad is None:  # every member joins the collective: an unused copy contributes zeros
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)
