"""The reference GPT's configuration: a frozen dataclass, made from a recipe's ``model`` block or by hand."""
from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import PluginError


class GPTConfigError(PluginError, ValueError):
    """A GPT configuration that cannot build a model (the message names the field and the fix)."""


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the reference GPT. ``kv_heads`` (grouped-query attention) defaults to ``heads``,
    ``ffn_hidden`` to ``4 * hidden``. ``tie_embeddings`` shares the embedding with the head (off by
    default: a pipeline then needs nothing tied across stages)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    seq_len: int
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    dropout: float = 0.0
    tie_embeddings: bool = False
    bias: bool = True
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # a mixture-of-experts feed-forward (plugin.expert_parallel) in every moe_every-th block; 0 experts: dense
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_every: int = 1
    moe_ffn_hidden: int | None = None
    moe_aux_loss_coef: float = 0.01
    moe_router: str = "softmax"
    moe_bias_update_rate: float = 0.001
    moe_z_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        problems = []
        for name in ("vocab", "hidden", "layers", "heads", "seq_len", "kv_heads", "ffn_hidden"):
            value = getattr(self, name)
            if value is None and name in ("kv_heads", "ffn_hidden"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name} must be an int >= 1, got {value!r}")
        if not problems:
            if self.hidden % self.heads:
                problems.append(f"hidden {self.hidden} is not divisible by heads {self.heads}")
            if self.heads % self.kv_heads_resolved:
                problems.append(f"heads {self.heads} is not divisible by kv_heads {self.kv_heads_resolved}")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout!r}")
        if problems:
            raise GPTConfigError("GPTConfig: " + "; ".join(problems))

    @property
    def kv_heads_resolved(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def ffn_hidden_resolved(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.hidden

    def is_moe_block(self, index: int) -> bool:
        """Whether block ``index`` holds a MoE feed-forward: blocks ``every - 1``, ``2 every - 1``, ...

        >>> [GPTConfig(vocab=8, hidden=8, layers=4, heads=2, seq_len=8, moe_experts=4, moe_every=2).is_moe_block(i)
        ...  for i in range(4)]
        [False, True, False, True]
        """
        return self.moe_experts > 0 and (index + 1) % self.moe_every == 0

    @property
    def moe_ffn_hidden_resolved(self) -> int:
        return self.moe_ffn_hidden if self.moe_ffn_hidden is not None else self.ffn_hidden_resolved

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def q_per_kv(self) -> int:
        """Query heads per key/value head (1 without grouped-query attention)."""
        return self.heads // self.kv_heads_resolved

    @classmethod
    def from_recipe_model(cls, model, **overrides) -> GPTConfig:
        """From a recipe's ``model`` block (:class:`plugin.recipe.spec.Model`); ``overrides`` set the fields a
        recipe does not carry (``tie_embeddings``, ``bias``, ``norm_eps``, ``init_std``)."""
        values = dict(vocab=model.vocab, hidden=model.hidden, layers=model.layers, heads=model.heads,
                      seq_len=model.seq_len, kv_heads=model.kv_heads_resolved,
                      ffn_hidden=model.ffn_hidden_resolved, dropout=model.dropout)
        moe = getattr(model, "moe", None)
        if moe is not None:
            values.update(moe_experts=moe.experts, moe_top_k=moe.top_k, moe_every=moe.every,
                          moe_ffn_hidden=moe.ffn_hidden, moe_aux_loss_coef=moe.aux_loss_coef,
                          moe_router=moe.router, moe_bias_update_rate=moe.bias_update_rate,
                          moe_z_loss_coef=moe.z_loss_coef)
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise GPTConfigError(f"GPTConfig has no field(s) {sorted(unknown)}")
        values.update(overrides)
        return cls(**values)
