"""Cross-entropy over logits split by vocabulary, without ever gathering the whole logits.

Rank ``r`` holds ``z_r``, the logits of vocabulary rows ``[start_r, end_r)``. For a token with target
``t`` the loss is ``log sum_v exp(z_v) - z_t``; with ``m = max_v z_v`` (for stability)::

    forward   m  = all-reduce-max_r(max z_r)
              S  = all-reduce-sum_r(sum exp(z_r - m))        \\ one all-reduce
              zt = all-reduce-sum_r(z_r[t - start_r] if t in range else 0)   / for both
              loss = log S - (zt - m)
    backward  dz_r = dloss * (softmax(z)_r - onehot(t)_r)    (local: no communication)

Two all-reduces of ``[tokens]`` floats instead of an all-gather of ``[tokens, vocab]``. Padded vocabulary
rows either arrive as ``-inf`` (:class:`VocabParallelLinear` writes them so) or are masked here when
``vocab_size`` is given. Computed in fp32 whatever the logits' dtype.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .comm import group_rank, group_size
from .errors import TensorParallelError


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_size, ignore_index):
        r = group_rank(group)
        local_vocab = logits.shape[-1]
        start = r * local_vocab
        z = logits.float()
        if vocab_size is not None and start + local_vocab > vocab_size:
            z = z.masked_fill(torch.arange(start, start + local_vocab, device=z.device) >= vocab_size,
                              float("-inf"))
        z = z.reshape(-1, local_vocab)
        t = targets.reshape(-1)

        m = z.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z = z - m.unsqueeze(-1)  # a new tensor: the caller's logits are left alone

        in_range = (t >= start) & (t < start + local_vocab)
        local_t = (t - start).masked_fill(~in_range, 0)
        zt = z.gather(1, local_t.unsqueeze(1)).squeeze(1).masked_fill(~in_range, 0.0)
        exp = z.exp_()
        sums = torch.stack([exp.sum(dim=-1), zt])
        dist.all_reduce(sums, group=group)
        total, zt = sums[0], sums[1]

        loss = total.log() - zt
        valid = t != ignore_index
        loss = loss.masked_fill(~valid, 0.0)

        exp.div_(total.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, local_t, in_range & valid, valid)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return loss.view(targets.shape)

    @staticmethod
    def backward(ctx, dloss):
        softmax, local_t, hit, valid = ctx.saved_tensors
        grad = softmax  # reused in place: this node runs once
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows[hit], local_t[hit]] -= 1.0
        grad.mul_((dloss.reshape(-1) * valid).unsqueeze(-1))
        return grad.view(ctx.shape).to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp_group, *,
                                 vocab_size: int | None = None, ignore_index: int = -100,
                                 reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of vocabulary-sharded ``logits [..., V/p]`` against whole ``targets [...]``.

    Equals ``F.cross_entropy`` on the gathered logits (same ``ignore_index``, ``reduction`` "mean" over the
    targets that are not ignored, "sum" or "none"). ``vocab_size``: the real vocabulary, when the logits
    carry padded rows that are not already ``-inf``. With no tensor parallelism (``tp_group`` None or of
    one rank) this is ``F.cross_entropy`` itself.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if group_size(tp_group) == 1:
        z = logits.float()
        if vocab_size is not None and vocab_size < z.shape[-1]:
            z = z[..., :vocab_size]
        return F.cross_entropy(z.reshape(-1, z.shape[-1]), targets.reshape(-1), ignore_index=ignore_index,
                               reduction=reduction).view(targets.shape if reduction == "none" else ())
    losses = _VocabParallelCrossEntropy.apply(logits, targets, tp_group, vocab_size, ignore_index)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (targets != ignore_index).sum()


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp_group=None, *,
                        name: str = "loss") -> torch.Tensor:
    """Mean cross-entropy over every token of ``targets [batch, seq]`` from ``logits [batch, seq, vocab]``.

    ``tp_group``: the tensor group when the logits are split by vocabulary (each rank ``[batch, seq, vocab/p]``):
    :func:`vocab_parallel_cross_entropy` then never gathers them. ``None`` for whole logits. ``name`` is the
    caller's, for the error on mismatched shapes (``gpt_loss``).
    """
    if logits.shape[:-1] != targets.shape:
        raise TensorParallelError(f"{name}: logits {tuple(logits.shape)} do not match targets "
                                  f"{tuple(targets.shape)}; expected logits [batch, seq, vocab] for targets "
                                  f"[batch, seq]")
    return vocab_parallel_cross_entropy(logits, targets, tp_group)
