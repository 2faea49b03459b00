"""Megatron-style tensor parallelism: autograd collectives, parallel layers, and plans that apply them.

    from plugin.tensor_parallel import apply_tensor_parallel
    model = apply_tensor_parallel(model, "auto", groups.tensor_group, sequence_parallel=False)

Modules: :mod:`.comm` (f/g and the sequence-parallel collectives), :mod:`.layers` (column, row and vocabulary-split
linears), :mod:`.embedding` (the vocabulary- and hidden-split embeddings), :mod:`.fused` (the column matmul with its
overlapped backward collective), :mod:`.heads` (key/value projections split by whole heads, replicated when fewer
than the ranks), :mod:`.cross_entropy`, :mod:`.random` (dropout streams), :mod:`.recompute`
(activation checkpointing that replays them), :mod:`.styles` (the styles a plan names), :mod:`.fit` (what fits
what: no silent swap), :mod:`.inplace` (collectives around a kept module's forward, bare parameters split),
:mod:`.plan` (``apply_tensor_parallel``), :mod:`.auto` (the "auto" plans), :mod:`.sharding` (slicing math),
:mod:`.state` (whole tensors back from the shards).
"""
from .comm import (
                   allreduce_grads_in_backward,
                   copy_to_tensor_region,
                   gather_from_sequence_region,
                   gather_from_tensor_region,
                   reduce_from_tensor_region,
                   reduce_scatter_to_sequence_region,
                   scatter_to_sequence_region,
                   scatter_to_tensor_region,
)
from .context import TensorParallelContext
from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import HiddenParallelEmbedding, VocabParallelEmbedding
from .errors import TensorParallelError
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelLinear
from .plan import apply_tensor_parallel, padding_report, resolve_plan
from .random import TensorParallelRNG
from .state import full_state_dict, full_tensor
from .styles import parse_style

__all__ = [
    "apply_tensor_parallel", "resolve_plan", "parse_style", "padding_report",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelLinear",
    "HiddenParallelEmbedding",
    "vocab_parallel_cross_entropy", "TensorParallelRNG", "TensorParallelContext", "TensorParallelError",
    "copy_to_tensor_region", "reduce_from_tensor_region", "scatter_to_tensor_region", "gather_from_tensor_region",
    "scatter_to_sequence_region", "gather_from_sequence_region", "reduce_scatter_to_sequence_region",
    "allreduce_grads_in_backward", "full_tensor", "full_state_dict",
]
