"""Transformer dimensions and the parameter counts that follow from them (pure).

A :class:`ModelSpec` is a recipe's ``model`` block (dimensions and dropout) plus the architecture choices
the block does not state: the MLP kind (GELU with two matrices, or Llama's SwiGLU with three), the norm
(LayerNorm with a bias, or RMSNorm), linear biases, learned position embeddings or RoPE, tied input/output
embeddings. A recipe's ``model`` block describes the plugin's reference GPT (``plugin/models/gpt.py``,
built by ``train.py``): GELU MLP, LayerNorm, biases, learned positions, an untied output layer;
:meth:`ModelSpec.from_recipe_model` assumes exactly that, and :meth:`ModelSpec.as_recipe_model` turns any
spec into the model a recipe of its dimensions describes. Presets (:mod:`plugin.planning.presets`) say their own
architecture.

Counting (Megatron-LM's ``theoretical_memory_usage.py`` counts the same way), with
h = hidden, a = heads, g = kv_heads, d = h/a, f = ffn_hidden, V = vocab, s = seq_len:

    attention   h(h + 2gd) [qkv] + h^2 [proj]             (+ h + 2gd + h biases)
    MLP         2hf (GELU) or 3hf (SwiGLU)                  (+ f + h or 2f + h biases)
    norms       2 per layer: 2h each (LayerNorm) or h (RMSNorm), and one final norm
    embeddings  Vh (+ sh learned positions) (+ Vh output layer when untied)

Tensor parallelism splits the matrices, their column biases and the vocabulary; norms, the row-parallel
biases and the position table stay whole on every tensor rank (Megatron's layout).

A mixture of experts (``moe_experts`` E > 0, the reference GPT's ``model.moe``) replaces the MLP of every
``moe_every``-th block by a router (hE, whole on every rank) and E experts of 2 h f_e (GELU, no biases), which an
expert axis of ``ep`` ranks divides by ``ep`` and the expert tensor degree by ``etp`` (:meth:`stage_expert_params`).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import Problem

MLP_KINDS = ("gelu", "swiglu")
NORM_KINDS = ("layernorm", "rmsnorm")
POSITION_KINDS = ("learned", "rope")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's dimensions and architecture choices."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    mlp: str = "gelu"
    norm: str = "layernorm"
    bias: bool = True
    positions: str = "learned"
    tied_embeddings: bool = True
    dropout: float = 0.0  # the recipe block's dropout probability; > 0 stores dropout masks
    moe_experts: int = 0  # a mixture of experts in every moe_every-th block (0: dense)
    moe_top_k: int = 2
    moe_every: int = 1
    moe_ffn_hidden: int | None = None
    # the recipe's model.moe settings that count nothing (router, the loss coefficients, bias_update_rate), where not
    # the recipe's defaults: (key, value) pairs, so that a written recipe trains the model it was planned for
    moe_options: tuple = ()
    name: str = "model"
    source: str = field(default="", compare=False)

    # ------------------------------------------------------------ resolved dims
    @property
    def kv(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.hidden

    @property
    def kv_dim(self) -> float:
        """Width of K (and of V): kv_heads x head dim; equals hidden without GQA."""
        return self.kv * self.hidden / self.heads

    @property
    def norm_params(self) -> int:
        return 2 * self.hidden if self.norm == "layernorm" else self.hidden

    # ------------------------------------------------------------ per layer
    def layer_params_split(self) -> tuple[float, float]:
        """(sharded by tensor parallelism, replicated on every tensor rank) parameters of one block."""
        h, f = self.hidden, self.ffn
        qkv_out = h + 2 * self.kv_dim
        sharded = h * qkv_out + h * h  # qkv (column) + proj (row)
        replicated = 2 * self.norm_params
        sharded += (3 if self.mlp == "swiglu" else 2) * h * f
        if self.bias:
            sharded += qkv_out + (2 * f if self.mlp == "swiglu" else f)  # column-parallel biases
            replicated += 2 * h  # the two row-parallel output biases
        return sharded, replicated

    def layer_params(self) -> float:
        return sum(self.layer_params_split())

    # ------------------------------------------------------------ mixture of experts
    def is_moe_block(self, index: int) -> bool:
        return self.moe_experts > 0 and (index + 1) % self.moe_every == 0

    def moe_blocks_on_stage(self, stage: int, pp: int) -> int:
        """MoE blocks among pipeline stage ``stage``'s blocks (the first stages hold one block more)."""
        first = sum(self.layers_on_stage(s, pp) for s in range(stage))
        return sum(self.is_moe_block(i) for i in range(first, first + self.layers_on_stage(stage, pp)))

    def mlp_params_split(self) -> tuple[float, float]:
        """(tensor-sharded, replicated) parameters of one dense MLP, which a MoE block has not."""
        h, f = self.hidden, self.ffn
        sharded = (3 if self.mlp == "swiglu" else 2) * h * f + ((2 * f if self.mlp == "swiglu" else f) if self.bias
                                                              else 0)
        return sharded, (h if self.bias else 0)

    @property
    def moe_ffn(self) -> int:
        """Each expert's inner size (the model's ffn size unless the MoE block says its own)."""
        return self.moe_ffn_hidden if self.moe_ffn_hidden is not None else self.ffn

    def expert_params(self) -> float:
        """One MoE block's experts: E x 2 h f_e (GELU, no biases; SwiGLU 3)."""
        return self.moe_experts * (3 if self.mlp == "swiglu" else 2) * self.hidden * self.moe_ffn

    def router_params(self) -> float:
        return self.hidden * self.moe_experts

    def layer_matmul_params(self) -> float:
        """Weights that take part in a matmul (no biases, no norms): the FLOPs count."""
        h, f = self.hidden, self.ffn
        return h * (h + 2 * self.kv_dim) + h * h + (3 if self.mlp == "swiglu" else 2) * h * f

    # ------------------------------------------------------------ whole model
    def embedding_params(self) -> float:
        return self.vocab * self.hidden

    def position_params(self) -> float:
        return self.seq_len * self.hidden if self.positions == "learned" else 0

    def output_params(self) -> float:
        """The output projection's own parameters: 0 when tied to the input embedding."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    def total_params(self) -> float:
        moe = sum(self.is_moe_block(i) for i in range(self.layers))
        return (self.layers * self.layer_params() + self.embedding_params() + self.position_params()
                + self.norm_params + self.output_params()
                + moe * (self.expert_params() + self.router_params() - sum(self.mlp_params_split())))

    def largest_layer_params(self) -> float:
        """The largest single module: a transformer block or the embedding table (ZeRO-3 gathers it whole)."""
        return max(self.layer_params(), self.embedding_params())

    # ------------------------------------------------------------ per rank
    def layers_on_stage(self, stage: int, pp: int) -> int:
        """Blocks on pipeline stage ``stage``: an even split, the first ``layers % pp`` stages one more."""
        base, extra = divmod(self.layers, pp)
        return base + (1 if stage < extra else 0)

    def padded_vocab(self, tp: int) -> int:
        """The vocabulary padded to a multiple of the tensor size (vocab-parallel embedding)."""
        return -(-self.vocab // tp) * tp

    def stage_expert_params(self, stage: int, pp: int = 1, ep: int = 1, etp: int = 1) -> float:
        """Expert parameters one rank of ``stage`` holds: its MoE blocks' experts over ``ep`` x ``etp`` ranks."""
        return self.moe_blocks_on_stage(stage, pp) * self.expert_params() / (ep * etp)

    def stage_params(self, stage: int, pp: int = 1, tp: int = 1, ep: int = 1, etp: int | None = None) -> float:
        """Parameters one rank of pipeline stage ``stage`` holds under tensor parallelism ``tp``.

        Stage 0 holds the embedding (and learned positions); the last stage holds the final norm and
        the output projection, a second copy of the embedding when tied embeddings cross a pipeline
        (Megatron and DeepSpeed's TiedLayerSpec keep one on each end and all-reduce their gradients).
        """
        sharded, replicated = self.layer_params_split()
        n = self.layers_on_stage(stage, pp) * (sharded / tp + replicated)
        moe = self.moe_blocks_on_stage(stage, pp)
        if moe:  # MoE blocks: no dense MLP; a whole router; the experts over ep x etp (the tensor degree by default)
            mlp_sharded, mlp_replicated = self.mlp_params_split()
            n += moe * (self.router_params() - mlp_sharded / tp - mlp_replicated)
            n += self.stage_expert_params(stage, pp, ep, tp if etp is None else etp)
        vocab_shard = self.padded_vocab(tp) * self.hidden / tp
        if stage == 0:
            n += vocab_shard + self.position_params()
        if stage == pp - 1:
            n += self.norm_params
            if not self.tied_embeddings or pp > 1:
                n += vocab_shard
        return n

    # ------------------------------------------------------------ building
    @classmethod
    def from_recipe_model(cls, model, name: str = "recipe") -> ModelSpec:
        """The reference GPT of a recipe's ``model`` block (GELU, LayerNorm, biases, learned positions, and an
        output layer of its own: :class:`plugin.models.gpt.GPTConfig` leaves embeddings untied by default)."""
        moe = getattr(model, "moe", None)
        experts = {} if moe is None else dict(moe_experts=moe.experts, moe_top_k=moe.top_k, moe_every=moe.every,
                                              moe_ffn_hidden=moe.ffn_hidden,
                                              moe_options=_moe_options({k: getattr(moe, k) for k in _MOE_OPTIONS}))
        return cls(layers=model.layers, hidden=model.hidden, heads=model.heads, vocab=model.vocab,
                   seq_len=model.seq_len, kv_heads=model.kv_heads, ffn_hidden=model.ffn_hidden,
                   tied_embeddings=False, dropout=model.dropout, name=name, **experts)

    def with_seq_len(self, seq_len: int) -> ModelSpec:
        return dataclasses.replace(self, seq_len=seq_len)

    def to_model_block(self) -> dict:
        """The recipe ``model`` block of these dimensions (architecture choices have no field there)."""
        block: dict[str, Any] = {"layers": self.layers, "hidden": self.hidden, "heads": self.heads}
        if self.kv != self.heads:
            block["kv_heads"] = self.kv
        if self.ffn != 4 * self.hidden:
            block["ffn_hidden"] = self.ffn
        block.update(vocab=self.vocab, seq_len=self.seq_len)
        if self.dropout:
            block["dropout"] = self.dropout
        if self.moe_experts:
            moe: dict[str, Any] = {"experts": self.moe_experts, "top_k": self.moe_top_k, "every": self.moe_every}
            if self.moe_ffn_hidden is not None:
                moe["ffn_hidden"] = self.moe_ffn_hidden
            block["moe"] = {**moe, **dict(self.moe_options)}
        return block

    def as_recipe_model(self) -> ModelSpec:
        """The model a recipe with :meth:`to_model_block` describes: these dimensions and dropout in the
        reference GPT's architecture (what :meth:`from_recipe_model` of that block gives, name kept)."""
        return dataclasses.replace(self, **_REFERENCE_GPT)

    def is_recipe_model(self) -> bool:
        """Whether a recipe's model block can describe this model exactly (it is the reference GPT)."""
        return all(getattr(self, k) == v for k, v in _REFERENCE_GPT.items())

    def architecture_differences(self, other: ModelSpec) -> list[str]:
        """How this model's architecture differs from ``other``'s, in words (``[]``: the same)."""
        words = {"mlp": {"gelu": "a GELU MLP (2 matrices)", "swiglu": "a SwiGLU MLP (3 matrices)"},
                 "norm": {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"},
                 "bias": {True: "biases", False: "no biases"},
                 "positions": {"learned": "learned positions", "rope": "RoPE"},
                 "tied_embeddings": {True: "tied embeddings", False: "an untied output layer"}}
        return [f"{words[k][getattr(self, k)]} instead of {words[k][getattr(other, k)]}"
                for k in words if getattr(self, k) != getattr(other, k)]

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.update(kv_heads=self.kv, ffn_hidden=self.ffn, parameters=int(self.total_params()))
        return out


# The architecture of the reference GPT, which is what a recipe's model block describes.
_REFERENCE_GPT = {"mlp": "gelu", "norm": "layernorm", "bias": True, "positions": "learned", "tied_embeddings": False}

_INT_FIELDS = ("layers", "hidden", "heads", "vocab", "seq_len", "kv_heads", "ffn_hidden")
_CHOICES = {"mlp": MLP_KINDS, "norm": NORM_KINDS, "positions": POSITION_KINDS}
_BOOLS = ("bias", "tied_embeddings")
# Keys a --model JSON may carry besides the dims and dropout: a preset's notes.
_IGNORED = ("source", "name", "description", "aliases", "paper_params")
_MOE_OPTIONS = ("aux_loss_coef", "router", "bias_update_rate", "z_loss_coef")  # model.moe keys that count nothing


def _moe_options(block: Mapping[str, Any]) -> tuple:
    """``model.moe``'s settings that count nothing, where they differ from the recipe's defaults, sorted pairs."""
    from ..recipe.spec import MoE

    defaults = {f.name: f.default for f in dataclasses.fields(MoE)}
    return tuple(sorted((k, block[k]) for k in _MOE_OPTIONS if k in block and block[k] != defaults[k]))


def _moe_fields(data: Mapping[str, Any], where: str) -> tuple[dict, list[Problem]]:
    """The spec's MoE fields from the ``moe`` block of the model block ``data``, or problems at ``where``.moe: the
    recipe's own rules for that block (its schema, and :func:`plugin.recipe.checks.check_expert`'s on the model)."""
    from ..recipe.checks import check_expert
    from ..recipe.schema import schema_problems
    from ..recipe.spec import Model, Recipe

    block, prefix = data["moe"], "$.model.moe"
    model = {k: data[k] for k in (f.name for f in dataclasses.fields(Model)) if k in data}

    def rooted(problems) -> list[Problem]:
        return [dataclasses.replace(p, path=f"{where}.moe{p.path[len(prefix):]}") for p in problems
                if p.path.startswith(prefix)]

    problems = rooted(schema_problems({"model": model}))
    if problems:
        return {}, problems
    recipe = Recipe.from_dict({"name": "plan", "batch": {"global": 1, "micro": 1}, "model": model})
    problems = rooted(p for p in check_expert(recipe, None) if p.is_error)
    return dict(moe_experts=block["experts"], moe_top_k=block.get("top_k", 2), moe_every=block.get("every", 1),
                moe_ffn_hidden=block.get("ffn_hidden"), moe_options=_moe_options(block)), problems


def spec_from_dict(data: Mapping[str, Any], name: str = "model",
                   where: str = "$") -> tuple[ModelSpec | None, list[Problem]]:
    """A :class:`ModelSpec` from a recipe ``model`` block (plus optional architecture keys), or problems.

    Architecture keys left out take the reference GPT's values (an untied output layer among them), so a
    plain recipe model block gives the model a recipe with that block trains."""
    import difflib

    problems: list[Problem] = []
    if not isinstance(data, Mapping):
        from ..recipe.jsontext import json_type

        return None, [Problem(where, f"a model is a JSON object, not {json_type(data)}",
                              "give layers, hidden, heads, vocab and seq_len")]
    known = set(_INT_FIELDS) | set(_CHOICES) | set(_BOOLS) | set(_IGNORED) | {"dropout"}
    known.add("moe")  # the recipe's block, read by _moe_fields once the dimensions are known good
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            problems.append(Problem(f"{where}.{key}", f"unknown key {key!r}",
                                    f"did you mean {close[0]!r}?" if close else "allowed: " + ", ".join(sorted(known))))
    for key in _INT_FIELDS:
        value = data.get(key)
        if value is None:
            if key not in ("kv_heads", "ffn_hidden"):
                problems.append(Problem(f"{where}.{key}", f"{key!r} is required", "give a positive integer"))
        elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(Problem(f"{where}.{key}", f"{value!r} is not a positive integer",
                                    "give a positive integer"))
    for key, choices in _CHOICES.items():
        if key in data and data[key] not in choices:
            problems.append(Problem(f"{where}.{key}", f"{data[key]!r} is not allowed",
                                    "use one of " + ", ".join(choices)))
    for key in _BOOLS:
        if key in data and not isinstance(data[key], bool):
            problems.append(Problem(f"{where}.{key}", f"{data[key]!r} is not true or false", "use true or false"))
    dropout = data.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        problems.append(Problem(f"{where}.dropout", f"{dropout!r} is not a probability in [0, 1)",
                                "give a number from 0 up to (not including) 1"))
    if problems:
        return None, problems
    heads, kv = data["heads"], data.get("kv_heads") or data["heads"]
    if heads % kv:
        problems.append(Problem(f"{where}.kv_heads", f"heads {heads} is not a multiple of kv_heads {kv}",
                                "grouped-query attention needs heads divisible by kv_heads"))
    if problems:
        return None, problems
    experts: dict = {}
    if "moe" in data:
        experts, problems = _moe_fields(data, where)
        if problems:
            return None, problems
    # An architecture key left out is the reference GPT's: a bare recipe model block is that model.
    kwargs = {**_REFERENCE_GPT, **{k: data[k] for k in (*_INT_FIELDS, *_CHOICES, *_BOOLS) if k in data}, **experts}
    kwargs["dropout"] = float(dropout)
    return ModelSpec(name=str(data.get("name", name)), source=str(data.get("source", "")), **kwargs), []


def params_text(n: float) -> str:
    """``6.74B``, ``355M``."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.3g}{unit}" if value < 100 else f"{math.floor(value + 0.5)}{unit}"
    return str(int(n))
