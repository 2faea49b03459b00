"""The styles of a tensor-parallel plan: the plugin's names, transformers' names for the same thing, what each does.

:data:`TABLE` is the one list (docs/tensor-parallel.md's table is held to it by a unit test): each style says what it
applies to (a linear layer, an embedding, any module, or a bare parameter) and what the plugin does with it, through
its own Megatron-style layers (:mod:`.layers`, :mod:`.embedding`) and collectives (:mod:`.comm`: ``f`` = identity
forward / all-reduce backward, ``g`` = all-reduce forward / identity backward). Every style of transformers 5.25's
causal-LM ``base_model_tp_plan`` is here; :data:`REFUSED` names the other transformers styles and why the plugin
refuses them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Style:
    """A parsed style. ``kind``: column, heads, row, vocab, embed_hidden, grad_sum, region, identity_expert,
    mla_kv_a, local or replicate; ``parts`` packed parts (``column:2`` for ``[gate | up]``); ``gather_output``
    (column, vocab): all-gather the output; ``split_input`` (row): the input comes whole and each rank keeps its
    slice."""

    kind: str
    gather_output: bool = False
    parts: int = 1
    split_input: bool = False
    text: str = ""


@dataclass(frozen=True)
class Entry:
    name: str
    style: Style
    hf: tuple[str, ...]
    targets: str  # "linear", "embedding", "linear or embedding", "module", "parameter", combinations with " | "
    does: str


TABLE = (
    Entry("column", Style("column"), ("colwise",), "linear | parameter",
          "ColumnParallelLinear: output features split, input whole (f before); a bare parameter is split along its "
          "output dimension (the second last; a 1-D one, e.g. per-head attention sinks, along its only one)"),
    Entry("column:K", Style("column", parts=2), ("packed_colwise",), "linear | parameter",
          "the same for an output of K packed parts ([gate | up], GPT-2's [q | k | v]), each part split on its own "
          "(transformers' packed_colwise is column:2)"),
    Entry("column_heads", Style("heads"), ("unit_colwise",), "linear",
          "HeadParallelLinear: a key or value projection split by whole heads; with fewer heads than tensor ranks, "
          "each head held by the tensor / heads ranks whose query heads read it, its weight's gradient summed over "
          "them, and the attention's num_key_value_groups made local (heads.py)"),
    Entry("column_gather", Style("column", gather_output=True), ("colwise_gather_output", "colwise_rep"), "linear",
          "ColumnParallelLinear that all-gathers its output: what follows sees it whole"),
    Entry("row", Style("row"), ("rowwise",), "linear | parameter",
          "RowParallelLinear: input features split (a column layer before it), partial products summed (g), bias "
          "added once; a bare parameter is split along its last dimension"),
    Entry("row:K", Style("row", parts=2), ("packed_rowwise",), "parameter",
          "a bare parameter split along its last dimension in K packed parts ([gate | up] stored input-major)"),
    Entry("row_split", Style("row", split_input=True), ("rowwise_split_input", "rowwise_rep"), "linear",
          "RowParallelLinear whose input comes whole: each rank keeps its slice of it, then as row"),
    Entry("vocab", Style("vocab"), ("embedding_rowwise",), "embedding | linear",
          "VocabParallelEmbedding: the vocabulary's rows split (padded to a multiple of tensor), the lookups summed "
          "(g); a head: VocabParallelLinear with vocabulary-split logits for the vocab-parallel cross entropy"),
    Entry("vocab_gather", Style("vocab", gather_output=True), (), "linear",
          "VocabParallelLinear head returning whole [..., vocab] logits (what a transformers loss expects)"),
    Entry("embed_hidden", Style("embed_hidden"), ("embedding_colwise",), "embedding",
          "HiddenParallelEmbedding: the hidden dimension split, each rank looks up its slice, all-gathered"),
    Entry("grad_sum", Style("grad_sum"), ("replicated_with_grad_allreduce",), "module",
          "the module stays whole (a norm between a column and a row layer, e.g. Qwen3's q_norm), its own forward "
          "runs on this rank's heads, and its parameters' gradients are summed over the tensor group inside "
          "autograd (allreduce_grads_in_backward)"),
    Entry("experts", Style("region"), ("moe_tp_experts",), "module",
          "a mixture-of-experts block whose expert parameters the plan splits (every one of them): its own forward "
          "runs on this rank's slice of every expert, each floating input enters with f (hidden states, routing "
          "weights: the router stays whole), the output leaves with g"),
    Entry("partial", Style("region"), ("all_reduce",), "module",
          "the same for any module whose parameters the plan splits and whose output is partial (a shared expert "
          "stored as bare tensors)"),
    Entry("identity_expert", Style("identity_expert"), ("moe_identity_expert",), "module",
          "an identity expert inside an experts block: its input divided by tensor, so the block's sum counts it "
          "once"),
    Entry("mla_kv_a", Style("mla_kv_a"), ("mla_kv_a_proj",), "linear",
          "DeepSeek's latent attention kv_a_proj_with_mqa: stays whole; the rope part of its output "
          "(config.qk_rope_head_dim), which reaches attention without a column layer, enters with f"),
    Entry("local", Style("local"), ("local_params",), "module",
          "a module whose bare parameters the plan splits (attention sinks): nothing else to do, the plugin's "
          "parameters are local tensors already"),
    Entry("replicate", Style("replicate"), ("replicate",), "linear | embedding | module | parameter",
          "left whole (the default for what no entry names)"),
)

BY_NAME = {e.name: e for e in TABLE}
HF_NAMES = {hf: e.name for e in TABLE for hf in e.hf}
REFUSED = {
    "sequence_parallel": "the plugin's sequence parallelism is the recipe's tensor_parallel.sequence_parallel, for "
                         "models that move their activations in and out of the sequence-split region themselves",
    **{s: "expert parallelism is not supported yet: give the experts moe_tp_experts (tensor parallelism)"
       for s in ("ep_router", "ep_dispatch_experts", "grouped_gemm")},
    **{s: "a transformers 4.x style; transformers 5 plans use colwise / rowwise / packed_* instead"
       for s in ("local_colwise", "local_rowwise", "local", "local_packed_rowwise", "gather", "isolated")},
}


def names() -> str:
    return ", ".join(e.name for e in TABLE)


def schema_names() -> list[str]:
    """The style names the recipe schema's ``tensor_parallel.plan`` enum lists (a test holds the schema to it):
    the table's, ``column:K`` for K of 2 to 4 and ``row:2``, then transformers' names."""
    plain = [e.name for e in TABLE if ":" not in e.name]
    return list(dict.fromkeys(plain + ["column:2", "column:3", "column:4", "row:2"] + list(HF_NAMES)))


def parse_style(text: str) -> Style:
    """``"column:3"`` -> ``Style("column", parts=3)``, ``"packed_colwise"`` -> ``column:2``; raises
    :class:`ValueError` with the accepted styles."""
    if not isinstance(text, str):
        raise ValueError(f"a style is a string, got {text!r} (supported: {names()})")
    name = HF_NAMES.get(text, text if ":" not in text else "")
    if name in BY_NAME:
        style = BY_NAME[name].style
        return Style(style.kind, style.gather_output, style.parts, style.split_input, text)
    kind, sep, k = text.partition(":")
    if sep and kind in ("column", "row") and k.isdigit() and int(k) >= 1:
        return Style(kind, parts=int(k), text=text)
    supported = f"supported: {names()}, or transformers' {', '.join(HF_NAMES)}"
    if text in REFUSED:
        raise ValueError(f"unsupported style {text!r}: {REFUSED[text]} ({supported}); give the module one of those "
                         "in an explicit plan, or 'replicate' to leave it whole")
    raise ValueError(f"unknown style {text!r} ({supported})")
