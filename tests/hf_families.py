"""Tiny models of any transformers causal-LM family, from the product's own sizing (plugin.models.hf), for tests.

``tiny_config("mixtral")`` is the family's config sized by :data:`TINY` (hidden 64, 2 layers, 4 heads, 2 key/value
heads where the family has grouped-query attention, else 4; MLP 128, vocabulary 96) with at most 4 experts, top-2,
and short attention windows (8 tokens) where the family has sliding or chunked attention, so that a sequence of 16
tokens already sees them. A few hundred thousand parameters; built in a fraction of a second.

The matrix of distributed tests reuses :data:`TP_FAMILIES` (the families trained at tensor 2 against one process,
chosen so that every tensor-parallel style they use is exercised) and :func:`families_with_tp_plan`.
"""
from __future__ import annotations

import dataclasses

from plugin.errors import PluginError
from plugin.recipe.spec import Model

TINY = Model(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=96, seq_len=64)
EXPERTS = (4, 2)
WINDOW = 8
_WINDOW_KEYS = ("sliding_window", "attention_chunk_size", "sliding_window_size")


def tiny_config(model_type: str, dims: Model = TINY, *, window: int | None = WINDOW):
    """The family's config sized by ``dims`` (grouped-query heads dropped where the family has none or refuses
    them), at most :data:`EXPERTS`, attention windows of ``window`` tokens (None: the family's own)."""
    from plugin.models.hf import family_config

    try:
        config = family_config(model_type, dims, experts=EXPERTS)
    except PluginError:  # no grouped-query attention (GPT-2, latent attention, ...): one kv head per head
        if dims.kv_heads is None or dims.kv_heads == dims.heads:
            raise
        config = family_config(model_type, dataclasses.replace(dims, kv_heads=None), experts=EXPERTS)
    if window is not None:
        for key in _WINDOW_KEYS:
            if isinstance(getattr(config, key, None), int):
                setattr(config, key, window)
    return config


def tiny_model(model_type: str, seed: int = 0, **kwargs):
    """A tiny model of the family with random weights drawn from ``seed`` (the same on every rank)."""
    import torch
    import transformers as tf

    config = tiny_config(model_type, **kwargs)
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(config)


def families_with_tp_plan() -> list[str]:
    """The causal-LM model types of the installed transformers whose config declares a ``base_model_tp_plan``."""
    import transformers as tf

    from plugin.models.hf import causal_lm_types

    return [t for t in causal_lm_types() if getattr(tf.CONFIG_MAPPING[t], "base_model_tp_plan", None)]
