"""Tiny models of any transformers causal-LM family, from the product's own sizing (plugin.models.hf), for tests.

``tiny_config("mixtral")`` is the family's config sized by :data:`TINY` (hidden 64, 2 layers, 4 heads, 2 key/value
heads where the family has grouped-query attention (:data:`KV_HEADS` where fewer), else 4; MLP 128, vocabulary 96)
with at most 4 experts, top-2, and short attention windows (8 tokens) where the family has sliding or chunked
attention, so that a sequence of 16 tokens already sees them. A few hundred thousand parameters; built in a
fraction of a second.

The matrix of distributed tests reuses :data:`TP_FAMILIES` (the families trained at tensor 2 against one process,
chosen so that every tensor-parallel style of transformers' causal-LM plans is exercised) and
:func:`families_with_tp_plan`; :data:`TP_REFUSED` and :data:`NOT_BUILT` say why the others with a plan do not train
(tests/unit/tensor_parallel/test_tp_families.py holds every family to them).
"""
from __future__ import annotations

import dataclasses

from plugin.errors import PluginError
from plugin.recipe.spec import Model

TINY = Model(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=96, seq_len=64)
EXPERTS = (4, 2)
# family -> its tiny model's key/value heads where TINY's 2 would leave a style idle: minicpm5_moe's unit_colwise holds
# its one key/value head whole on both tensor ranks, its gradient summed over them
KV_HEADS = {"minicpm5_moe": 1}
WINDOW = 8
_WINDOW_KEYS = ("sliding_window", "attention_chunk_size", "sliding_window_size")

# family -> plan entries put over its "auto" plan (None: "auto" as it is), and what the family exercises
TP_FAMILIES = {
    "llama": {"model.embed_tokens": "embedding_colwise"},  # colwise, rowwise, an embedding split by hidden
    "gemma2": None,         # a scaled embedding (embed_scale kept), tied to its head; logit soft-capping, windows
    "qwen3": None,          # replicated_with_grad_allreduce (per-head q_norm / k_norm)
    "phi3": None,           # colwise_gather_output, rowwise_split_input (fused qkv and gate_up left whole)
    "gpt_neox": None,       # embedding_rowwise, fused per-head query_key_value, parallel residual, partial rotary
    "cohere": None,         # a tied embedding split by vocabulary, parallel attention + MLP, logit scale
    "mixtral": None,        # moe_tp_experts, packed_colwise (3-D gate_up), the router whole
    "deepseek_v2": None,    # mla_kv_a_proj (latent attention), shared experts, a dense first layer
    "longcat_flash": None,  # moe_identity_expert (zero-computation experts)
    "llama4_text": None,    # packed_rowwise (gate_up stored input-major), a shared expert, chunked attention
    "granite_swa": None,    # local_params (attention sinks split by head)
    "inkling2_text": None,  # replicate, rowwise_split_input
    "inkling_text": {"model.embed_tokens": "replicate"},  # all_reduce (its normed embedding: refused by "auto")
    # unit_colwise (one key/value head held by both ranks), gated attention; its auto entries written out: a recipe
    # states kv_heads 1 at tensor 2 only with an explicit plan naming the per-head style (validate cannot see "auto")
    "minicpm5_moe": {},
    "kolibri1_1": None,     # a plan that leaves attention whole (its indexer must pick one set of keys), MLPs split
}

# family -> why "auto" refuses it at tensor 2 (a piece of the refusal's text)
TP_REFUSED = {
    "doge": "parameter 'model.layers.0.self_attn.A' ((2,)) is per head",
    "dory": "DoryLMHead, a subclass of Linear with a forward of its own",
    "inkling_text": "InklingNormedEmbedding, a subclass of Embedding with a forward of its own",
}
# family -> why no tiny model of it is built (a piece of the error's text): transformers 5.25's own defaults do not
# build a model (the first three), or the recipe's layer count has no key of its own in the family's config
NOT_BUILT = {
    "cohere_compass_text": "KeyError: 'full_attention'",
    "lfm2_moe": "'NoneType' object is not subscriptable",
    "qwen4_exp_text": "unsupported operand type(s) for //: 'NoneType' and 'NoneType'",
    "hrm_text": "the hrm_text family says num_hidden_layers 16",
    "nemotron_h": "has none of num_hidden_layers, num_layers",
}


def tiny_config(model_type: str, dims: Model | None = None, *, window: int | None = WINDOW):
    """The family's config sized by ``dims`` (default :data:`TINY`, with the family's :data:`KV_HEADS`; grouped-query
    heads dropped where the family has none or refuses them), at most :data:`EXPERTS`, attention windows of
    ``window`` tokens (None: the family's own)."""
    from plugin.models.hf import family_config

    if dims is None:
        dims = dataclasses.replace(TINY, kv_heads=KV_HEADS.get(model_type, TINY.kv_heads))

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


def tp_plan(model, family: str) -> str | dict:
    """The plan :data:`TP_FAMILIES` trains ``family`` with: "auto", or the entries of its auto plan that name something
    in ``model`` (an explicit plan refuses a glob matching nothing), with the family's entries over them."""
    import fnmatch

    from plugin.tensor_parallel.auto import auto_plan

    changes = TP_FAMILIES.get(family)
    if changes is None:
        return "auto"
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    plan = {glob: style for glob, style in auto_plan(model).items() if fnmatch.filter(names, glob)}
    return {**plan, **changes}


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
    "minicpm5_moe": "gated attention (q_gate_proj), a dense first layer then mixture of experts with a shared one",
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
    "kolibri1_1": "does more than hand the hidden states on ('if i in self.config.index_layers:'",
}


def families_with_pp_plan() -> list[str]:
    """The causal-LM model types of the installed transformers whose config declares a ``base_model_pp_plan``."""
    import transformers as tf

    from plugin.models.hf import causal_lm_types

    return [t for t in causal_lm_types() if getattr(tf.CONFIG_MAPPING[t], "base_model_pp_plan", None)]


def pp_model(model_type: str, dims: Model = PP_DIMS, seed: int = 0, overrides: dict | None = None):
    """:func:`tiny_model` of ``dims`` with the family's ``overrides`` (default :data:`PP_OVERRIDES`)."""
    import torch
    import transformers as tf

    config = tiny_config(model_type, dims)
    for key, value in (PP_OVERRIDES if overrides is None else overrides).get(model_type, {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(config)

# the families the layouts combining axes train (tests/dist/test_family_matrix.py): tensor 2 x pipeline 2, ZeRO-3
MATRIX_FAMILIES = list(PP_FAMILIES)
# the pipeline overrides they train with: all but Cohere's per-head q/k norms, which its tp plan omits and tensor
# parallelism refuses by name (tests/unit/tensor_parallel/test_tp_families.py); minicpm5_moe with one key/value head,
# held by both tensor ranks of each stage (KV_HEADS)
MATRIX_OVERRIDES = {**PP_OVERRIDES, "cohere": {}, "minicpm5_moe": {"num_key_value_heads": KV_HEADS["minicpm5_moe"]}}


def padded_batch(rows: int, vocab: int, seq: int, *, seed: int = 100, shortest: int = 6) -> dict:
    """A padded batch of Hugging Face rows (the family tests' one batch, the same every step, by default): rows of
    uneven lengths (``shortest``..seq), every third left-padded, the rest right-padded, labels -100 on the padding.
    The layout and context tests draw one per step (``seed`` 100 + step, ``shortest`` 8)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, seq), generator=gen)
    mask = torch.zeros(rows, seq, dtype=torch.int64)
    for r in range(rows):
        n = int(torch.randint(shortest, seq + 1, (1,), generator=gen))
        if r % 3 == 2:
            mask[r, seq - n:] = 1
        else:
            mask[r, :n] = 1
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
