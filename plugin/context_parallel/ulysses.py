"""All-to-all attention (DeepSpeed's Ulysses): trade the sequence split for a head split, attend over the whole
sequence, trade back.

On context rank ``r`` of ``C``: one all-to-all (:func:`.comm.scatter_heads_gather_sequence`) turns this rank's tokens
of every head into every rank's tokens of head slice ``r`` (for queries, keys and values: ``heads`` and
``kv_heads`` each divisible by ``C``, which the recipe checks ask for), the tokens are put back in sequence order
(:func:`.chunks.natural_order`), torch's SDPA attends causally (the key padding mask added) with the rank's dropout
stream, and the inverse all-to-all returns this rank's tokens of every head. Everything is autograd: SDPA's own
backward, and each all-to-all's backward is the other. Four all-to-alls of the activations per layer forward (q, k,
v, output), against the ring's ``C - 1`` hops of keys and values.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .chunks import natural_order
from .comm import gather_heads_scatter_sequence, scatter_heads_gather_sequence


def _full_mask(key_mask: torch.Tensor | None, causal: bool, seq: int, device):
    """(``attn_mask`` for SDPA or None, rows that see a key or None): a row that sees no key would make SDPA's
    softmax NaN, so it is given key 0 and its output is zeroed afterwards (the ring's answer for such a row)."""
    if key_mask is None:
        return None, None
    mask = key_mask.to(device=device, dtype=torch.bool)[:, None, None, :]  # [b, 1, 1, S]
    if causal:
        mask = mask & torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    else:
        mask = mask.expand(-1, -1, seq, -1)
    seen = mask.any(-1, keepdim=True)  # [b, 1, S, 1]
    first = torch.zeros(seq, dtype=torch.bool, device=device)
    first[0] = True
    return mask | (~seen & first), seen


def all_to_all_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *, causal: bool = True,
                         key_mask: torch.Tensor | None = None, dropout_p: float = 0.0, scale: float | None = None):
    """The same contract as :func:`plugin.context_parallel.ring.ring_attention`, by two all-to-alls around SDPA."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    n = q.shape[2] // 2
    order = natural_order(size, n, q.device)
    back = torch.argsort(order)
    qs, ks, vs = (scatter_heads_gather_sequence(t, group).index_select(2, order) for t in (q, k, v))
    seq = qs.shape[2]
    mask, seen = _full_mask(key_mask, causal, seq, q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    y = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, dropout_p=dropout_p,
                                       is_causal=causal and mask is None, scale=scale,
                                       enable_gqa=ks.shape[1] != qs.shape[1])
    if seen is not None:
        y = y * seen
    return gather_heads_scatter_sequence(y.index_select(2, back), group)
