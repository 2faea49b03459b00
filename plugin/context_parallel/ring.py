"""Ring attention, exact: every query attends to every key of the whole sequence while each context rank holds only
its two chunks (:mod:`.chunks`); keys and values travel around the context group, block by block.

Forward, on context rank ``r`` of ``C`` (queries of chunks ``r`` and ``2C-1-r``): at step ``s = 0 .. C-1`` it holds
the keys and values of rank ``r - s`` (their chunks), starts sending them to rank ``r + 1`` and receiving rank
``r - s - 1``'s (:class:`.comm.RingShift`, point-to-point), and meanwhile attends its queries to the block it holds:
for each (query chunk, key chunk) pair, all of it when the key chunk comes earlier in the sequence, the causal
triangle on the diagonal, nothing when it comes later (causal), the key padding mask applied. Each block gives a
softmax-normalised partial output and its log-sum-exp ``l_b``; partials merge by the online-softmax rule::

    l = log(exp(l_a) + exp(l_b)),   o = exp(l_a - l) o_a + exp(l_b - l) o_b

which is the softmax over the union of the blocks' keys. Kept for backward: ``q, k, v``, the output and ``l`` (what
a fused kernel keeps: no score matrix). Backward recomputes each block's probabilities from ``l`` (flash-attention's
backward), adds its ``dq`` locally, and passes the keys and values around the ring again together with their
gradient accumulators ``dk, dv``: each rank adds its share to the block it holds and sends the sum on, and after
``C`` steps every accumulator has come home with the contributions of all ranks.

Dropout (``dropout_p > 0``) draws each block's mask from its own generator, seeded from one draw of the caller's
stream (the context rank's dropout stream, forked around the call); backward redraws the same masks from the same
seeds, and a recompute (activation checkpointing) that replays the stream redraws them too. Grouped-query attention:
keys and values travel with ``kv_heads`` heads, each serving ``heads / kv_heads`` query heads. Blocks are computed in
fp32 (fp64 for fp64 inputs) whatever the input dtype; the output has the input's.
"""
from __future__ import annotations

import math

import torch

from .chunks import chunk_ids
from .comm import RingShift

KV_TAG, GRAD_TAG = 11, 12  # the two streams of one ring: keys/values, their gradients


def _visible(a: int, b: int, causal: bool) -> str | None:
    """How query chunk ``a`` sees key chunk ``b``: ``"full"``, ``"diag"`` (the causal triangle) or None."""
    if not causal or b < a:
        return "full"
    return "diag" if b == a else None


def _mask(kind: str, key_mask: torch.Tensor | None, chunk: int, n: int, device) -> torch.Tensor | None:
    """A boolean ``[b or 1, 1, 1, n, n]`` of the allowed (query, key) pairs of one block, or None for all."""
    mask = None
    if kind == "diag":
        mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None, None, None]
    if key_mask is not None:
        keys = key_mask[:, chunk * n:(chunk + 1) * n][:, None, None, None, :]
        mask = keys if mask is None else mask & keys
    return mask


def _keep(shape, p: float, seed: int, device, dtype) -> torch.Tensor:
    """Block ``seed``'s dropout mask, 1 where kept (the same tensor in forward, backward and any recompute)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return torch.empty(shape, device=device).bernoulli_(1.0 - p, generator=gen).to(dtype)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype blocks are computed in: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _probabilities(q, k, lse, mask, scale):
    """``exp(q k^T scale - lse)``, zero where masked or where the row sees no key at all (lse -inf)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(s - finite[..., None]), lse


def _merge(out, lse, out_b, lse_b):
    new = torch.logaddexp(lse, lse_b)
    finite = torch.isfinite(new)
    zero = torch.zeros_like(new)
    w_old = torch.where(finite, torch.exp(lse - new), zero)
    w_new = torch.where(finite, torch.exp(lse_b - new), zero)
    return out * w_old[..., None] + out_b * w_new[..., None], new


class _Blocks:
    """The (step, query chunk, key chunk) blocks one rank computes, the same in forward and backward."""

    def __init__(self, rank: int, size: int, n: int, causal: bool, key_mask, device, dropout_p: float, seed: int):
        self.rank, self.size, self.n, self.causal = rank, size, n, causal
        self.key_mask, self.device, self.dropout_p, self.seed = key_mask, device, dropout_p, seed

    def of_step(self, step: int):
        """``(i, j, mask, keep)`` for query chunk slot i and key chunk slot j that see each other at ``step``."""
        src = (self.rank - step) % self.size
        for i, a in enumerate(chunk_ids(self.rank, self.size)):
            for j, b in enumerate(chunk_ids(src, self.size)):
                kind = _visible(a, b, self.causal)
                if kind is None:
                    continue
                yield i, j, _mask(kind, self.key_mask, b, self.n, self.device), (step * 2 + i) * 2 + j


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, key_mask, dropout_p, scale, seed):
        ring = RingShift(group)
        size, rank = ring_size_rank(group)
        b, h, s2, d = q.shape
        hk, n = k.shape[1], s2 // 2
        acc = _acc(q.dtype)
        qf = q.to(acc).reshape(b, hk, h // hk, s2, d)
        blocks = _Blocks(rank, size, n, causal, key_mask, q.device, dropout_p, seed)
        out = [torch.zeros(b, hk, h // hk, n, d, device=q.device, dtype=acc) for _ in range(2)]
        lse = [torch.full((b, hk, h // hk, n), float("-inf"), device=q.device, dtype=acc) for _ in range(2)]
        kv = torch.stack([k, v])
        for step in range(size):
            if step + 1 < size:
                ring.start(kv, KV_TAG)  # the next block travels while this one is computed
            kf, vf = kv[0].to(acc).unsqueeze(2), kv[1].to(acc).unsqueeze(2)
            for i, j, mask, block in blocks.of_step(step):
                qc, kc, vc = qf[..., i * n:(i + 1) * n, :], kf[..., j * n:(j + 1) * n, :], vf[..., j * n:(j + 1) * n, :]
                p, lse_b = _probabilities(qc, kc, None, mask, scale)
                if dropout_p:
                    p = p * _keep(p.shape, dropout_p, seed + block, q.device, acc) / (1.0 - dropout_p)
                out[i], lse[i] = _merge(out[i], lse[i], torch.matmul(p, vc), lse_b)
            if step + 1 < size:
                kv = ring.wait()
        y = torch.cat(out, dim=-2).reshape(b, h, s2, d).to(q.dtype)
        ctx.save_for_backward(q, k, v, y, torch.cat(lse, dim=-1), key_mask)
        ctx.group, ctx.causal, ctx.dropout_p, ctx.scale, ctx.seed = group, causal, dropout_p, scale, seed
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, y, lse, key_mask = ctx.saved_tensors
        group, scale, dropout_p = ctx.group, ctx.scale, ctx.dropout_p
        kv_ring, grad_ring = RingShift(group), RingShift(group)
        size, rank = ring_size_rank(group)
        b, h, s2, d = q.shape
        hk, n, g = k.shape[1], s2 // 2, h // k.shape[1]
        acc = _acc(q.dtype)
        qf = q.to(acc).reshape(b, hk, g, s2, d)
        dyf = dy.to(acc).reshape(b, hk, g, s2, d)
        delta = (dyf * y.to(acc).reshape(b, hk, g, s2, d)).sum(-1)  # rowsum(dO o O) = sum_j P_ij dP_ij
        dq = torch.zeros_like(qf)
        blocks = _Blocks(rank, size, n, ctx.causal, key_mask, q.device, dropout_p, ctx.seed)
        kv = torch.stack([k, v])
        for step in range(size):
            if step + 1 < size:
                kv_ring.start(kv, KV_TAG)
            kf, vf = kv[0].to(acc).unsqueeze(2), kv[1].to(acc).unsqueeze(2)
            dkv = torch.zeros(2, b, hk, s2, d, device=q.device, dtype=acc)
            for i, j, mask, block in blocks.of_step(step):
                rows, cols = slice(i * n, (i + 1) * n), slice(j * n, (j + 1) * n)
                qc, kc, vc, do = qf[..., rows, :], kf[..., cols, :], vf[..., cols, :], dyf[..., rows, :]
                p, _ = _probabilities(qc, kc, lse[..., rows], mask, scale)
                dp = torch.matmul(do, vc.transpose(-1, -2))
                if dropout_p:
                    keep = _keep(p.shape, dropout_p, ctx.seed + block, q.device, acc) / (1.0 - dropout_p)
                    dkv[1, ..., cols, :] += torch.matmul((p * keep).transpose(-1, -2), do).sum(2)
                    dp = dp * keep
                else:
                    dkv[1, ..., cols, :] += torch.matmul(p.transpose(-1, -2), do).sum(2)
                ds = p * (dp - delta[..., rows, None])
                dq[..., rows, :] += torch.matmul(ds, kc) * scale
                dkv[0, ..., cols, :] += torch.matmul(ds.transpose(-1, -2), qc).sum(2) * scale
            if step > 0:
                dkv += grad_ring.wait()  # what the ranks before added to this block's gradient
            grad_ring.start(dkv, GRAD_TAG)  # on to the next rank; after the last step, home to the block's owner
            if step + 1 < size:
                kv = kv_ring.wait()
        dkv = grad_ring.wait()  # this rank's own keys' and values' gradient, every rank's share summed
        return (dq.reshape(b, h, s2, d).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None, None, None, None)


def ring_size_rank(group) -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_world_size(group), dist.get_rank(group)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *, causal: bool = True,
                   key_mask: torch.Tensor | None = None, dropout_p: float = 0.0, scale: float | None = None):
    """Attention of this rank's queries ``q [b, heads, 2n, d]`` over the whole sequence, whose keys and values
    ``k, v [b, kv_heads, 2n, d]`` are spread over the context ``group`` (each rank its chunks, :mod:`.chunks`).

    ``key_mask [b, S]`` (bool, the whole sequence, True = attend) masks padded keys; a query that sees no key gets
    zeros. ``dropout_p`` draws from the current default stream (fork the rank's own stream around the call).
    Returns ``[b, heads, 2n, d]``, differentiable in ``q, k, v`` (see the module docstring)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    seed = int(torch.randint(0, 2 ** 62, (1,), device=q.device).item()) if dropout_p else 0
    if key_mask is not None:
        key_mask = key_mask.to(device=q.device, dtype=torch.bool)
    return _RingAttention.apply(q, k, v, group, causal, key_mask, float(dropout_p), scale, seed)
