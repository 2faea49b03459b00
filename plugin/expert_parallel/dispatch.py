"""Dropless token dispatch: every (token, slot) choice reaches its expert, however unbalanced the routing.

For ``T`` tokens with ``k`` choices each, on each rank of an expert group of ``p`` ranks each holding ``L`` experts
(expert ``e`` lives on rank ``e // L``)::

    choices sorted by expert (stable)     -> T*k rows, expert-major
    counts per expert [p, L], exchanged   -> how many rows each rank sends to each of this rank's experts
    all-to-all (uneven splits)            -> the rows for this rank's experts, by source rank then expert
    regrouped by local expert, run        -> each expert on all of its rows at once
    all-to-all back (splits swapped)      -> each row's output where it came from, in sorted order
    weighted by the router, summed        -> [T, hidden]

No capacity factor, no padding, nothing dropped: the layout computes what one process computes (one process is the
same code with a group of one). On the meta device (the dry run) a uniform routing stands in for the router's.
Autograd runs through both all-to-alls (:func:`.comm.all_to_all`).
"""
from __future__ import annotations

import torch

from .comm import all_to_all, exchange_counts, group_size


def dispatch_combine(tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, experts, group) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{chosen[t, j]}(tokens[t])`` for every token ``t``, the experts spread over
    ``group``; ``experts(rows, counts)`` runs this rank's experts on rows grouped by local expert."""
    p, total = group_size(group), experts.total
    local = total // p
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    source = order // chosen.shape[-1]  # the token of each sorted choice
    rows = tokens.index_select(0, source)
    meta = flat.device.type == "meta"  # the dry run: no router values, a uniform routing stands in (uniform_counts)
    counts = (uniform_counts(flat.numel(), total) if meta else torch.bincount(flat, minlength=total)).view(p, local)
    if p == 1:
        out = experts(rows, counts[0].tolist())
    else:
        received = exchange_counts(counts, group)  # [p, L]: rows from rank r for each of this rank's experts
        if meta:  # recorded, not answered: under a uniform routing every rank sends every expert the same rows
            received = counts
        send, recv = counts.sum(dim=1).tolist(), received.sum(dim=1).tolist()
        arrived = all_to_all(rows, send, recv, group)  # by source rank, then local expert
        by_expert = _expert_major(received.cpu()).to(tokens.device)  # built on the host from the counts
        out = experts(arrived.index_select(0, by_expert), received.sum(dim=0).tolist())
        out = out.index_select(0, torch.argsort(by_expert))  # back to source-major order
        out = all_to_all(out, recv, send, group)
    scale = weights.reshape(-1).index_select(0, order).to(out.dtype)
    return torch.zeros_like(tokens).index_add(0, source, out * scale.unsqueeze(-1))


def uniform_counts(choices: int, experts: int) -> torch.Tensor:
    """``choices`` spread over ``experts`` as evenly as integers go (the first ones one more): the routing the dry
    run assumes, where meta tensors hold no router scores.

    >>> uniform_counts(10, 4).tolist()
    [3, 3, 2, 2]
    """
    return torch.tensor([choices // experts + (e < choices % experts) for e in range(experts)])


def _expert_major(received: torch.Tensor) -> torch.Tensor:
    """The permutation that takes rows ordered (source rank, local expert) to (local expert, source rank).

    >>> _expert_major(torch.tensor([[1, 2], [0, 1]])).tolist()  # rank 0 sent 1 row to e0, 2 to e1; rank 1: 0, 1
    [0, 1, 2, 3]
    >>> _expert_major(torch.tensor([[1, 1], [1, 1]])).tolist()
    [0, 2, 1, 3]
    """
    p, local = received.shape
    starts = torch.cumsum(received.reshape(-1), 0) - received.reshape(-1)  # first row of each (rank, expert) block
    starts = starts.view(p, local)
    pieces = [torch.arange(int(starts[r, e]), int(starts[r, e]) + int(received[r, e]))
              for e in range(local) for r in range(p)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
