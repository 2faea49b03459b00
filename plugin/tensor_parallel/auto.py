"""The ``"auto"`` plans, and what known model families need besides a plan.

``auto_plan`` picks, in order:

1. the model's own ``tensor_parallel_plan()`` (the reference GPT has one);
2. transformers GPT-2 (``config.model_type == "gpt2"``): fused ``c_attn`` as ``column:3``, ``c_proj``
   row, MLP column/row, ``wte`` vocab and the tied ``lm_head`` vocab_gather (whole logits, as the HF
   forward and its loss expect);
3. any transformers model with a tensor-parallel plan (``model._tp_plan``, else the config's
   ``base_model_tp_plan`` under ``base_model_prefix``), e.g. Llama, with transformers' style names
   translated; a head plan of ``colwise_gather_output`` on a vocabulary-sized output becomes
   ``vocab_gather`` (pads when the vocabulary does not divide), and a head tied to a split embedding
   follows it.

Checks and fix-ups by family also live here: attention heads must split whole across ranks (a
divisible width is not enough: a head cut in two computes garbage), and GPT-2's attention must learn that
its fused projection is now ``3 x hidden/p`` wide. Nothing here imports transformers.
"""
from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from .errors import TensorParallelError

GPT2_PLAN = {"h.*.attn.c_attn": "column:3", "h.*.attn.c_proj": "row",
             "h.*.mlp.c_fc": "column", "h.*.mlp.c_proj": "row", "wte": "vocab"}


def _model_type(model: nn.Module) -> str:
    return getattr(getattr(model, "config", None), "model_type", "") or ""


def _prefix(model: nn.Module) -> str:
    base = getattr(model, "base_model", model)
    return "" if base is model else f"{model.base_model_prefix}."


def auto_plan(model: nn.Module) -> dict[str, str]:
    """The plan ``"auto"`` stands for, for this model; raises when there is none."""
    own = getattr(model, "tensor_parallel_plan", None)
    if callable(own):
        return dict(own())
    if _model_type(model) == "gpt2":
        prefix = _prefix(model)
        plan = {prefix + k: v for k, v in GPT2_PLAN.items()}
        head = getattr(model, "lm_head", None)
        if isinstance(head, nn.Linear):
            plan["lm_head"] = "vocab_gather"
        return plan
    hf = _hf_plan(model)
    if hf:
        return hf
    raise TensorParallelError(
        f"no automatic tensor-parallel plan for {type(model).__name__}: it is not the reference GPT, not "
        f"transformers GPT-2, and has no base_model_tp_plan; pass a plan mapping module-name globs to "
        f"styles, e.g. {{'layers.*.attn.q_proj': 'column', 'layers.*.attn.o_proj': 'row'}}")


def _hf_plan(model: nn.Module) -> dict[str, str]:
    plan: dict[str, str] = dict(getattr(model, "_tp_plan", None) or {})
    if not plan:
        base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
        plan = {_prefix(model) + k: v for k, v in base.items()}
    if not plan:
        return {}
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    modules = dict(model.named_modules())
    out = {}
    for glob, style in plan.items():
        module = modules.get(glob)
        if style == "colwise_gather_output" and isinstance(module, nn.Linear) and module.out_features == vocab:
            style = "vocab_gather"
        out[glob] = style
    head, embed = getattr(model, "lm_head", None), None
    get_embed = getattr(model, "get_input_embeddings", None)
    if callable(get_embed):
        embed = get_embed()
    if isinstance(head, nn.Linear) and isinstance(embed, nn.Embedding) and head.weight is embed.weight:
        embed_name = next(n for n, m in modules.items() if m is embed)
        if "lm_head" in out:
            out[embed_name] = "vocab"
            out["lm_head"] = "vocab_gather"
        else:
            out.pop(embed_name, None)
    return out


def _heads_problem(what: str, heads: int, tp: int) -> list[str]:
    if heads % tp:
        return [f"{what}: {heads} attention heads cannot be split whole over tensor size {tp}; use a "
                f"tensor size that divides {heads}"]
    return []


def check_known_model(model: nn.Module, styles: Mapping[str, object], tp: int,
                         sequence_parallel: bool) -> list[str]:
    """What a known family needs beyond the per-module checks (``styles``: the modules being split)."""
    config = getattr(model, "config", None)
    if config is None or tp == 1 or not styles:
        return []
    problems: list[str] = []
    if _model_type(model) == "gpt2":
        for name, style in styles.items():
            if name.endswith("attn.c_attn") and getattr(style, "parts", 1) != 3:
                problems.append(f"module {name!r} (GPT-2's fused q, k, v): split it with style 'column:3', so "
                                f"each rank gets whole heads of q, k and v")
        if any(n.endswith("attn.c_attn") for n in styles):
            problems += _heads_problem(f"{type(model).__name__} (n_head)", config.n_head, tp)
        if getattr(config, "add_cross_attention", False):
            problems.append("GPT-2 with cross-attention: its q_attn/c_attn split is not supported; "
                            "leave the cross-attention modules whole")
        return problems
    attention = [n for n in styles if n.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj")]
    if attention:
        heads = getattr(config, "num_attention_heads", None)
        kv = getattr(config, "num_key_value_heads", None) or heads
        if heads:
            problems += _heads_problem(f"{type(model).__name__} (num_attention_heads)", heads, tp)
        if kv and kv != heads:
            problems += _heads_problem(f"{type(model).__name__} (num_key_value_heads)", kv, tp)
    return problems


def fix_known_model(model: nn.Module, tp: int) -> None:
    """After the swap: tell GPT-2 attention modules how wide their split fused projection is."""
    if _model_type(model) != "gpt2" or tp == 1:
        return
    for module in model.modules():
        c_attn = getattr(module, "c_attn", None)
        if hasattr(module, "split_size") and getattr(c_attn, "parts", 1) == 3:
            module.split_size = c_attn.weight.shape[0] // 3
            module.num_heads = module.split_size // module.head_dim
