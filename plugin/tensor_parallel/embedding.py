"""A vocabulary-split embedding and its sequence-parallel form (Megatron's ``reduce_scatter_embeddings``); a
hidden-split embedding (transformers' ``embedding_colwise``).

Rank ``r`` of ``p`` holds the rows ``[start_r, end_r)`` of the (padded) table ``E``. For token ids
``t [batch, seq]`` it looks up the ids in its range and writes zeros for the others: the partial
``P_r = E_r[t]``, one nonzero partial per token. Then:

* plain form: ``y = sum_q P_q`` (all-reduce, ``g``), the whole ``[batch, seq, hidden]`` on every rank;
* sequence-parallel form (``sequence_parallel=True``): ``y_r = chunk_r(sum_q P_q^T)`` along the sequence
  (reduce-scatter of the ``[seq, batch, hidden]`` transpose), this rank's ``[seq/p, batch, hidden]`` slice,
  which is what the first transformer block of a sequence-parallel model takes. Half the bytes of the
  all-reduce and no separate split; backward is the all-gather of ``dy`` (as for the split).

Position embeddings in the sequence-parallel form: ``forward(ids, position_embeddings=pos)`` with a
replicated ``pos [seq, hidden]`` adds each rank's own sequence slice of ``pos`` to its partial before the
reduce-scatter, so the sum holds every position exactly once:
``y_r = chunk_r(sum_q P_q^T) + chunk_r(pos)``. Backward: the reduce-scatter's all-gather leaves the whole
gradient of the sum ``G`` on every rank, and ``d pos = sum_batch G`` (all rows) there, identical on every
rank, with no collective of its own. (Megatron-LM, with learned positions, all-reduces, adds them, then
splits; this computes the same numbers with the cheaper reduce-scatter.)

A scaled embedding (Gemma's ``*ScaledWordEmbedding``: ``forward = embedding(ids) * embed_scale``) keeps its scale:
``from_embedding(module, ..., scaled=True)`` copies ``embed_scale`` (a buffer under the same name, or a number) and
multiplies each partial lookup by it, in the weight's dtype as Gemma does (``a * s + 0 * s`` is ``a * s`` exactly).
The copy checks, on real weights, that the module's own forward is that product.

:class:`HiddenParallelEmbedding` splits the other dimension: rank ``r`` holds ``E[:, chunk_r]``, looks up every id
in it and the slices are all-gathered along the last dimension (backward: each rank keeps its slice's gradient).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .comm import (
    gather_from_tensor_region,
    group_rank,
    group_size,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
)
from .errors import TensorParallelError
from .sharding import mark_sharded, padded_size, shard, shard_range


class _AddOwnSequenceSlice(torch.autograd.Function):
    """Before a reduce-scatter along dim 0: ``x + pos`` on this rank's slice of the sequence only.

    forward ``y = x``, with ``y[chunk_r] += pos[chunk_r]`` broadcast over the batch (``x [seq, batch, h]``,
    ``pos [seq, h]``); backward ``dx = dy``, ``dpos = sum_batch dy`` over all rows: ``dy`` is the whole
    gradient of the sum over ranks (the reduce-scatter's backward gathers it), in which each row of
    ``pos`` appears once. Only valid immediately before :func:`reduce_scatter_to_sequence_region`.
    """

    @staticmethod
    def forward(ctx, x, pos, rank, size):
        n = x.shape[0] // size
        y = x.clone()
        y[rank * n:(rank + 1) * n] += pos[rank * n:(rank + 1) * n].unsqueeze(1)
        return y

    @staticmethod
    def backward(ctx, dy):
        return dy, dy.sum(1), None, None


class VocabParallelEmbedding(nn.Module):
    """An embedding split by vocabulary rows, padded to a multiple of ``p`` (``padding`` rows of zeros).

    Rank ``r`` looks up the ids in its range ``[vocab_start, vocab_end)``, writes zeros for the others,
    and the sum over the group (``g``) gives every rank the whole, replicated embedding ``[batch, seq,
    hidden]``. With ``sequence_parallel=True`` the sum is a reduce-scatter along the sequence instead, and
    the output is this rank's slice, sequence first: ``[seq/p, batch, hidden]`` (see the module docstring,
    also for ``position_embeddings``).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group, *, padding_idx: int | None = None,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        whole = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx, device=device, dtype=dtype)
        self._shard_from(whole.weight, tp_group, padding_idx, sequence_parallel)

    @classmethod
    def from_embedding(cls, module: nn.Embedding, tp_group, *, sequence_parallel: bool = False,
                       scaled: bool = False) -> VocabParallelEmbedding:
        """This rank's rows of an existing ``nn.Embedding``; the module itself is left as is. ``scaled``: the
        module multiplies its lookups by its ``embed_scale`` (see the module docstring)."""
        _check_options(cls.__name__, module)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._shard_from(module.weight, tp_group, module.padding_idx, sequence_parallel)
        _copy_scale(layer, module, scaled)
        return layer

    def _shard_from(self, weight, tp_group, padding_idx, sequence_parallel) -> None:
        self.scaled = False
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = group_size(tp_group), group_rank(tp_group)
        self.sequence_parallel = sequence_parallel
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padded_num_embeddings = padded_size(self.num_embeddings, self.tp_size)
        self.padding = self.padded_num_embeddings - self.num_embeddings
        start, end = shard_range(self.padded_num_embeddings, self.tp_size, self.tp_rank)
        self.vocab_start, self.vocab_end = start, end
        self.padding_idx = padding_idx
        self.local_padding_idx = padding_idx - start if padding_idx is not None and start <= padding_idx < end \
            else None
        self.weight = mark_sharded(nn.Parameter(shard(weight, 0, self.tp_size, self.tp_rank, pad=True).detach(),
                                                requires_grad=weight.requires_grad), 0, padding=self.padding)

    def _partial(self, ids: torch.Tensor) -> torch.Tensor:
        """``P_r``: this rank's rows looked up, zeros for ids outside its range."""
        if self.tp_size == 1:
            return _scale(self, F.embedding(ids, self.weight, self.local_padding_idx))
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self.local_padding_idx)
        return _scale(self, out.masked_fill(outside.unsqueeze(-1), 0.0))

    def forward(self, ids: torch.Tensor, position_embeddings: torch.Tensor | None = None) -> torch.Tensor:
        """``ids [batch, seq]`` (any shape in the plain form) -> the embedding, plus ``position_embeddings``
        (``[seq, hidden]``, replicated) when given."""
        if not self.sequence_parallel:
            out = reduce_from_tensor_region(self._partial(ids), self.tp_group)
            return out if position_embeddings is None else out + position_embeddings
        if ids.dim() != 2:
            raise TensorParallelError(f"VocabParallelEmbedding(sequence_parallel=True) takes token ids [batch, seq], "
                                      f"got shape {tuple(ids.shape)}")
        seq = ids.shape[1]
        if seq % self.tp_size:
            raise TensorParallelError(f"sequence parallelism: the sequence ({seq} tokens) is not divisible by the "
                                      f"tensor size ({self.tp_size}); use a sequence length that is a multiple "
                                      f"of {self.tp_size}")
        if position_embeddings is not None and tuple(position_embeddings.shape) != (seq, self.embedding_dim):
            raise TensorParallelError(f"VocabParallelEmbedding: position_embeddings must be [seq, hidden] = "
                                      f"[{seq}, {self.embedding_dim}], got {tuple(position_embeddings.shape)}")
        x = self._partial(ids).transpose(0, 1).contiguous()  # [seq, batch, hidden]
        if position_embeddings is not None:
            if self.tp_size == 1:
                x = x + position_embeddings.unsqueeze(1)
            else:
                x = _AddOwnSequenceSlice.apply(x, position_embeddings, self.tp_rank, self.tp_size)
        return reduce_scatter_to_sequence_region(x, self.tp_group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}, "
                f"local_rows=[{self.vocab_start}, {self.vocab_end}), padding={self.padding}, "
                f"sequence_parallel={self.sequence_parallel}, scaled={self.scaled}")


def _check_options(layer: str, module: nn.Embedding) -> None:
    unsupported = [n for n in ("max_norm", "sparse", "scale_grad_by_freq") if getattr(module, n)]
    if unsupported:
        raise TensorParallelError(f"{layer}: nn.Embedding option(s) {unsupported} are not supported; leave this "
                                  f"embedding whole (style 'replicate')")


def _copy_scale(layer: nn.Module, module: nn.Embedding, scaled: bool) -> None:
    """``layer.embed_scale`` from ``module`` (a buffer stays a buffer, persistent or not, as it was), checked against
    the module's own forward when its weight holds values."""
    layer.scaled = scaled
    if not scaled:
        return
    scale = module.embed_scale
    if isinstance(scale, torch.Tensor):
        persistent = "embed_scale" not in module._non_persistent_buffers_set
        layer.register_buffer("embed_scale", scale.detach().clone(), persistent=persistent)
    else:
        layer.embed_scale = float(scale)
    if module.weight.device.type == "meta" or (isinstance(scale, torch.Tensor) and scale.device.type == "meta"):
        return  # checked when the values exist: the meta path re-runs this cut on the whole module (materialize)
    ids = torch.arange(min(module.num_embeddings, 16), device=module.weight.device)
    with torch.no_grad():
        own = module(ids)
        expected = F.embedding(ids, module.weight, module.padding_idx) * _as_factor(scale, module.weight.dtype)
    if not torch.equal(own, expected):
        raise TensorParallelError(f"{type(module).__qualname__}: its forward is not embedding(ids) * embed_scale "
                                  f"(the scaled-embedding rule), so {type(layer).__name__} cannot reproduce it; "
                                  "give it 'replicate' in an explicit tensor_parallel.plan")


def _as_factor(scale, dtype):
    return scale.to(dtype) if isinstance(scale, torch.Tensor) else scale


def _scale(layer: nn.Module, out: torch.Tensor) -> torch.Tensor:
    return out * _as_factor(layer.embed_scale, layer.weight.dtype) if layer.scaled else out


class HiddenParallelEmbedding(nn.Module):
    """An embedding split by the hidden dimension: rank ``r`` holds ``E[:, chunk_r]`` (``embedding_dim`` divisible
    by the tensor size); every rank looks up every id in its slice, and the slices are all-gathered (``[batch, seq,
    hidden]`` whole on every rank; backward: each rank keeps the gradient of its slice)."""

    @classmethod
    def from_embedding(cls, module: nn.Embedding, tp_group, *, scaled: bool = False) -> HiddenParallelEmbedding:
        """This rank's columns of an existing ``nn.Embedding``; the module itself is left as is."""
        _check_options(cls.__name__, module)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.tp_group = tp_group
        layer.tp_size, layer.tp_rank = group_size(tp_group), group_rank(tp_group)
        layer.num_embeddings, layer.embedding_dim = module.weight.shape
        if layer.embedding_dim % layer.tp_size:
            raise TensorParallelError(f"HiddenParallelEmbedding: embedding_dim {layer.embedding_dim} is not divisible "
                                      f"by tensor size {layer.tp_size}; leave this embedding whole (style "
                                      "'replicate')")
        layer.padding_idx = module.padding_idx
        layer.weight = mark_sharded(nn.Parameter(shard(module.weight.detach(), 1, layer.tp_size, layer.tp_rank),
                                                 requires_grad=module.weight.requires_grad), 1)
        _copy_scale(layer, module, scaled)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = _scale(self, F.embedding(ids, self.weight, self.padding_idx))
        return gather_from_tensor_region(out, self.tp_group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}, "
                f"local_weight={tuple(self.weight.shape)}, scaled={self.scaled}")


__all__ = ["HiddenParallelEmbedding", "VocabParallelEmbedding"]
