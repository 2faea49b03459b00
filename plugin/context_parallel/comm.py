"""Collectives of context parallelism, named by what they do to the activations, each with its forward and
backward (the tensor-parallel ones are :mod:`plugin.tensor_parallel.comm`; Megatron's ``mappings.py`` names them
the same way).

Notation: ``C`` ranks in the context group, ``r`` this rank's index; attention tensors are ``[batch, heads, seq,
head_dim]`` (SDPA's layout); ``S_r`` this rank's tokens (its two chunks, :mod:`.chunks`), ``H_j`` the j-th of ``C``
equal slices of the heads.

* :func:`scatter_heads_gather_sequence` / :func:`gather_heads_scatter_sequence`: the two all-to-alls of Ulysses
  (DeepSpeed's sequence parallelism), each the other's backward.
* :class:`RingShift`: send a tensor to the next context rank and receive the previous rank's, point-to-point and
  without waiting, so the caller computes on the block it holds meanwhile (no autograd: the ring attention's own
  forward and backward use it, :mod:`.ring`).

Every function takes its group explicitly and returns the input unchanged for a group of one. The collectives are
called as ``torch.distributed.<name>`` at call time, so a test can count them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .errors import ContextParallelError


def group_size(group) -> int:
    """Ranks in ``group``; ``None`` means no context parallelism (1)."""
    return 1 if group is None else dist.get_world_size(group)


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """``out[j] = x_j[r]``: slice j of dim 0 goes to rank j, rank j's slice r arrives as slice j."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    b, h, s, d = x.shape
    c = group_size(group)
    if h % c:
        raise ContextParallelError(f'"all_to_all" context parallelism gives each of the {c} context ranks whole heads, '
                                   f"but this attention has {h} (per tensor rank) -> use \"method\": \"ring\", or a "
                                   f"head count divisible by {c}")
    send = x.reshape(b, c, h // c, s, d).transpose(0, 1)  # [C, b, h/C, s, d]: head slice j for rank j
    got = _all_to_all(send, group)  # [C, b, h/C, s, d]: rank j's tokens of my head slice
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * s, d)


def _sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    b, hc, cs, d = x.shape
    c = group_size(group)
    send = x.reshape(b, hc, c, cs // c, d).permute(2, 0, 1, 3, 4)  # [C, b, h/C, s, d]: rank j's tokens back to it
    got = _all_to_all(send, group)  # [C, b, h/C, s, d]: my tokens of head slice j
    return got.transpose(0, 1).reshape(b, c * hc, cs // c, d)


class _ScatterHeadsGatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _sequence_to_heads(dy, ctx.group), None


class _GatherHeadsScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _heads_to_sequence(dy, ctx.group), None


def scatter_heads_gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """``[b, h, S_r, d] -> [b, h/C, S_0 | S_1 | ... | S_{C-1}, d]``: rank r keeps head slice ``H_r`` of every rank's
    tokens (tokens in rank order; :func:`plugin.context_parallel.chunks.natural_order` sorts them).

    forward: one all-to-all (head slice j to rank j); backward: the inverse all-to-all
    (:func:`gather_heads_scatter_sequence` of the gradient), since the map is a permutation of elements.
    """
    return x if group_size(group) == 1 else _ScatterHeadsGatherSequence.apply(x, group)


def gather_heads_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """``[b, h/C, S_0 | ... | S_{C-1}, d] -> [b, h, S_r, d]``: every head of this rank's own tokens again.

    forward: one all-to-all (rank j's tokens back to rank j); backward: the inverse all-to-all
    (:func:`scatter_heads_gather_sequence` of the gradient).
    """
    return x if group_size(group) == 1 else _GatherHeadsScatterSequence.apply(x, group)


class RingShift:
    """Point-to-point around the context group: :meth:`start` sends a tensor to the next rank (``r + 1 mod C``) and
    receives the previous rank's into a buffer of the same shape, returning at once; :meth:`wait` gives the received
    tensor. Both directions go in one ``batch_isend_irecv`` (NCCL needs the pair together; gloo runs them in its
    threads while the caller computes). ``tag`` keeps two streams of one ring apart (keys/values, their gradients)."""

    def __init__(self, group):
        self.group = group
        ranks = dist.get_process_group_ranks(group)
        me = ranks.index(dist.get_rank())
        self.next, self.prev = ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]
        self._pending: list = []

    def start(self, send: torch.Tensor, tag: int = 0) -> None:
        send = send.contiguous()
        recv = torch.empty_like(send)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, self.next, self.group, tag),
                                        dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)])
        self._pending.append((works, send, recv))

    def wait(self) -> torch.Tensor:
        """The tensor of the oldest :meth:`start`, received from the previous rank (in start order)."""
        works, _send, recv = self._pending.pop(0)
        for w in works:
            w.wait()
        return recv
