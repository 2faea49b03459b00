"""The experts' gradients, reduced over the expert-data group (the ranks holding the same experts).

Every rank's loss is its share of the global batch's (the back ends average the other gradients over data x
context); an expert's gradient on its rank already holds what every rank of its expert group sent it (the
all-to-all's backward), so the ranks holding the same expert add theirs and divide by data x context::

    grad_e = (1 / (data x context)) sum over the expert-data group of grad_e

which is the data x context average of the one-process gradient's pieces: the same as one process. An expert that
got no token has a zero gradient (the dispatch runs every local expert, on zero rows if need be), so every rank joins
the same collectives.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def reduce_expert_grads(params: list[torch.nn.Parameter], group, replicas: int) -> None:
    """Sum the gradients of ``params`` over ``group`` (``None``: a group of one) and divide by ``replicas`` (data x
    context), in place; one flat all-reduce."""
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    if group is not None and dist.get_world_size(group) > 1:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        for g, piece in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(piece.view_as(g))
    if replicas > 1:
        for g in grads:
            g.div_(replicas)
