"""Megatron's tensor-parallel layers: column- and row-split linears, and a vocabulary-split head.

(The vocabulary-split embedding is :mod:`.embedding`'s.)

For ``Y = X A^T + b`` with ``A`` of shape ``[out, in]``:

* :class:`ColumnParallelLinear` splits ``A`` by rows (output features): rank ``r`` computes
  ``Y_r = X A_r^T + b_r``, a slice of ``Y``'s last dimension. Input replicated (``f`` before it).
* :class:`RowParallelLinear` splits ``A`` by columns (input features): rank ``r`` computes the partial
  ``X_r A_r^T`` from its slice of ``X``; the sum over ranks (``g``) completes ``Y``, and ``b`` is added
  once, after the sum.

A column layer feeding a row layer (attention: qkv then proj; MLP: fc then proj) needs exactly one
all-reduce forward (``g`` after the row layer) and one backward (``f`` before the column layer).

Sequence parallelism (``sequence_parallel=True``) replaces ``f`` by an all-gather of the sequence and ``g``
by a reduce-scatter of it: the input of a column layer and the output of a row layer are then
``[seq/p, batch, hidden]`` slices (sequence first). The gathered input is kept for backward, so backward
needs no second all-gather (Megatron re-gathers to save that memory). A column layer's matmul and its
input collective are one autograd node (:mod:`.fused`): backward runs the collective on ``dx`` while it
computes the weight gradient.

Every layer is built whole and then sharded (:meth:`ColumnParallelLinear.from_linear` etc. cut the
weights a module already holds), so one seed on every rank gives the same function as the unsharded model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .comm import (
    allreduce_grads_in_backward,
    gather_from_tensor_region,
    group_rank,
    group_size,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
    scatter_to_tensor_region,
)
from .errors import TensorParallelError
from .fused import column_linear
from .sharding import mark_sharded, padded_size, shard, shard_range


def linear_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight [out, in], bias)`` of an ``nn.Linear`` or a transformers ``Conv1D`` (stored ``[in, out]``)."""
    if isinstance(module, nn.Linear):
        return module.weight, module.bias
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.weight.t(), module.bias
    raise TypeError(f"{type(module).__name__} is not a linear layer")


def _record_transposed(layer: nn.Module, source: nn.Module) -> None:
    """A ``Conv1D`` source stores ``[in, out]``: its sharded weight (``[out, in]`` here) says so, for checkpoints
    that write it under the source's name and shape. Never guessed from shapes: a square one looks untransposed."""
    if type(source).__name__ == "Conv1D":
        layer.weight.partition_transposed = True


def _param(tensor: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    return nn.Parameter(tensor.detach(), requires_grad=requires_grad)


class _ParallelLinear(nn.Module):
    """What column and row layers share: the group, the sizes, and a readable repr."""

    def _setup(self, tp_group, in_features: int, out_features: int, sequence_parallel: bool) -> None:
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.tp_rank = group_rank(tp_group)
        self.in_features = in_features
        self.out_features = out_features
        self.sequence_parallel = sequence_parallel

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, tp={self.tp_size}, "
                f"local_weight={tuple(self.weight.shape)}, bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}")


class ColumnParallelLinear(_ParallelLinear):
    """``Y = X A^T + b`` with ``A`` split by output features; rank ``r`` holds ``A_r [out/p, in]`` and ``b_r``.

    ``gather_output=False`` (the usual case, a row layer follows) returns this rank's slice of ``Y``'s last
    dimension; ``True`` all-gathers the whole ``Y``. ``parts = k`` says the output is ``k`` packed parts
    (GPT-2's fused ``[q | k | v]``), each split on its own (see :mod:`.sharding`).
    """

    def __init__(self, in_features: int, out_features: int, tp_group, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        whole = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._shard_from(whole.weight, whole.bias, tp_group, gather_output, sequence_parallel, parts=1)

    @classmethod
    def from_linear(cls, module: nn.Module, tp_group, *, gather_output: bool = False,
                    sequence_parallel: bool = False, parts: int = 1) -> ColumnParallelLinear:
        """This rank's slice of an existing ``nn.Linear`` (or ``Conv1D``); the module itself is left as is."""
        weight, bias = linear_weights(module)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._shard_from(weight, bias, tp_group, gather_output, sequence_parallel, parts)
        _record_transposed(layer, module)
        return layer

    def _shard_from(self, weight, bias, tp_group, gather_output, sequence_parallel, parts) -> None:
        out_features, in_features = weight.shape
        self._setup(tp_group, in_features, out_features, sequence_parallel)
        p, r = self.tp_size, self.tp_rank
        if out_features % (p * parts):
            raise TensorParallelError(
                f"ColumnParallelLinear: out_features {out_features} is not divisible by tensor size {p}"
                + (f" x {parts} packed parts" if parts > 1 else "")
                + "; pick a tensor size that divides it, or leave this layer whole (style 'replicate')")
        if gather_output and parts > 1:
            raise TensorParallelError("ColumnParallelLinear: gather_output with packed parts is not supported")
        self.gather_output = gather_output
        self.parts = parts
        self.weight = mark_sharded(_param(shard(weight, 0, p, r, parts=parts), weight.requires_grad), 0, parts=parts)
        self.bias = None if bias is None else mark_sharded(
            _param(shard(bias, 0, p, r, parts=parts), bias.requires_grad), 0, parts=parts)

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``Y``, before any gather of the output: ``F.linear`` after ``f`` (or the
        sequence all-gather), fused so that backward overlaps the collective with the weight gradient."""
        return column_linear(x, self.weight, self.bias, self.tp_group, self.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._local(x)
        return gather_from_tensor_region(y, self.tp_group) if self.gather_output else y


class VocabParallelLinear(ColumnParallelLinear):
    """The output projection onto a vocabulary, split by vocabulary rows and padded to a multiple of ``p``.

    ``vocab_size`` rows are padded with zero rows to :func:`padded_size`; ``padding`` says how many. The
    logits of padded rows are ``-inf`` in the sharded output (no real token has them, so softmax and
    :func:`vocab_parallel_cross_entropy` ignore them exactly); ``gather_output=True`` drops them instead and
    returns ``[..., vocab_size]`` logits, the same as the unsharded ``nn.Linear``.
    """

    def __init__(self, in_features: int, vocab_size: int, tp_group, *, bias: bool = False,
                 gather_output: bool = False, sequence_parallel: bool = False, device=None, dtype=None):
        nn.Module.__init__(self)
        whole = nn.Linear(in_features, vocab_size, bias=bias, device=device, dtype=dtype)
        self._shard_from(whole.weight, whole.bias, tp_group, gather_output, sequence_parallel, parts=1)

    def _shard_from(self, weight, bias, tp_group, gather_output, sequence_parallel, parts) -> None:
        assert parts == 1
        vocab_size, in_features = weight.shape
        self._setup(tp_group, in_features, vocab_size, sequence_parallel)
        p, r = self.tp_size, self.tp_rank
        self.vocab_size = vocab_size
        self.padded_vocab_size = padded_size(vocab_size, p)
        self.padding = self.padded_vocab_size - vocab_size
        start, end = shard_range(self.padded_vocab_size, p, r)
        self.vocab_start, self.vocab_end = start, min(end, vocab_size)
        self.gather_output = gather_output
        self.parts = 1
        self.weight = mark_sharded(_param(shard(weight, 0, p, r, pad=True), weight.requires_grad), 0,
                                   padding=self.padding)
        self.bias = None if bias is None else mark_sharded(
            _param(shard(bias, 0, p, r, pad=True), bias.requires_grad), 0, padding=self.padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._local(x)
        if self.gather_output:
            y = gather_from_tensor_region(y, self.tp_group)
            return y[..., :self.vocab_size] if self.padding else y
        local_real = self.vocab_end - self.vocab_start
        if local_real < y.shape[-1]:  # this rank holds padded rows: their logits are -inf
            pad = torch.arange(y.shape[-1], device=y.device) >= local_real
            y = y.masked_fill(pad, float("-inf"))
        return y

    def extra_repr(self) -> str:
        return super().extra_repr() + f", vocab={self.vocab_size}, padding={self.padding}"


class RowParallelLinear(_ParallelLinear):
    """``Y = X A^T + b`` with ``A`` split by input features; rank ``r`` holds ``A_r [out, in/p]``, ``b`` whole.

    ``input_is_parallel=True`` (a column layer precedes) takes this rank's slice of ``X``'s last dimension;
    ``False`` takes the whole ``X`` and keeps the slice. The partial products are summed over the group
    (all-reduce; with sequence parallelism, reduce-scatter along the sequence), then ``b`` is added once.
    """

    def __init__(self, in_features: int, out_features: int, tp_group, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        whole = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._shard_from(whole.weight, whole.bias, tp_group, input_is_parallel, sequence_parallel)

    @classmethod
    def from_linear(cls, module: nn.Module, tp_group, *, input_is_parallel: bool = True,
                    sequence_parallel: bool = False) -> RowParallelLinear:
        """This rank's slice of an existing ``nn.Linear`` (or ``Conv1D``); the module itself is left as is."""
        weight, bias = linear_weights(module)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._shard_from(weight, bias, tp_group, input_is_parallel, sequence_parallel)
        _record_transposed(layer, module)
        return layer

    def _shard_from(self, weight, bias, tp_group, input_is_parallel, sequence_parallel) -> None:
        out_features, in_features = weight.shape
        self._setup(tp_group, in_features, out_features, sequence_parallel)
        p, r = self.tp_size, self.tp_rank
        if in_features % p:
            raise TensorParallelError(
                f"RowParallelLinear: in_features {in_features} is not divisible by tensor size {p}; pick a "
                f"tensor size that divides it, or leave this layer whole (style 'replicate')")
        if sequence_parallel and not input_is_parallel:
            raise TensorParallelError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        self.input_is_parallel = input_is_parallel
        self.weight = mark_sharded(_param(shard(weight, 1, p, r), weight.requires_grad), 1)
        self.bias = None if bias is None else _param(bias.clone(), bias.requires_grad)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``bias``, if given, is used instead of ``self.bias``: an owner that already arranged for its
        gradient (the reference GPT block sums all its replicated gradients in one all-reduce) passes it.
        """
        if not self.input_is_parallel:
            x = scatter_to_tensor_region(x, self.tp_group)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(y, self.tp_group)
        else:
            y = reduce_from_tensor_region(y, self.tp_group)
        if bias is None and self.bias is not None:
            bias = self.bias
            if self.sequence_parallel:  # replicated bias on a slice of the tokens: sum its gradient
                (bias,) = allreduce_grads_in_backward([bias], self.tp_group)
        return y if bias is None else y + bias


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelLinear", "linear_weights"]
