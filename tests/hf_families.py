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


# Pipeline stages (plugin.models.hf_stages) ------------------------------------------------------------------------

PP_DIMS = dataclasses.replace(TINY, layers=4)  # cut uniform at pipeline 2: [Embed, 0, 1 | 2, 3, Head]
# the families trained at pipeline 2 against one process, and the pipeline features each exercises
PP_FAMILIES = {
    "gemma2": "scaled embedding, attention and final logit soft-capping, sliding/full masks on both stages, tied "
              "embedding across stages",
    "gemma3_text": "global and local rotary tables, q/k norms, scaled embedding, tied embedding across stages",
    "qwen3": "q/k norms",
    "phi3": "partial rotary (0.5 here), fused qkv and gate-up projections",
    "gpt_neox": "a plan of 4 entries (embed_in, emb_dropout, layers, final_layer_norm), parallel residual, partial "
                "rotary (0.25)",
    "cohere": "parallel attention and MLP, logit scale, q/k layer norms, tied embedding across stages",
    "cohere2": "sliding layers with rotary and full layers without, logit scale, tied embedding across stages",
    "mixtral": "mixture of experts (4, top-2)",
    "granite": "embedding, residual, attention and logit multipliers",
    "phi": "embedding dropout in the plan, parallel attention and MLP, partial rotary (0.5)",
    "qwen3_next": "linear-attention (gated delta) layers with their own masks, partial rotary, mixture of experts",
    "deepseek_v3": "latent attention (MLA), dense then mixture-of-experts layers",
    "gpt_oss": "attention sinks, sliding/full masks, mixture of experts",
}
PP_OVERRIDES = {  # config values that make a feature act (the tiny config's defaults leave it at 1 or off)
    "phi3": {"rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5, "rope_type": "default"}},
    "cohere": {"use_qk_norm": True},
    "granite": {"embedding_multiplier": 4.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2,
                "logits_scaling": 2.0},
    "deepseek_v3": {"first_k_dense_replace": 1},
}
# the families with a base_model_pp_plan that hf_stages refuses, and the words of the reason
PP_REFUSED = {
    "deepseek_v4": "['hc_head'] outside its base_model_pp_plan holds parameters",
    "hy_v4": "['hc_head'] outside its base_model_pp_plan holds parameters",
    "gemma3n_text": "'embed_tokens_per_layer'",
    "gemma4_text": "'embed_tokens_per_layer'",
    "gemma4_unified_text": "does more than hand the hidden states on ('if i == self.first_kv_shared_layer_idx",
    "glm_moe_dsa": "does more than hand the hidden states on (\"hidden_states, topk_indices = decoder_layer(",
    "phi4_multimodal": "['embed_tokens_extend'] outside its base_model_pp_plan holds parameters",
}


def families_with_pp_plan() -> list[str]:
    """The causal-LM model types of the installed transformers whose config declares a ``base_model_pp_plan``."""
    import transformers as tf

    from plugin.models.hf import causal_lm_types

    return [t for t in causal_lm_types() if getattr(tf.CONFIG_MAPPING[t], "base_model_pp_plan", None)]


def pp_model(model_type: str, dims: Model = PP_DIMS, seed: int = 0):
    """:func:`tiny_model` of ``dims`` with the family's :data:`PP_OVERRIDES`."""
    import torch
    import transformers as tf

    config = tiny_config(model_type, dims)
    for key, value in PP_OVERRIDES.get(model_type, {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(config)
