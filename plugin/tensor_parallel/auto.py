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

import fnmatch
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
    return _complete(model, out)


def _complete(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """What transformers' plans leave out, by pattern (each exact, measured against one process):

    * experts whose ``gate_up_proj`` transformers' experts decorator declares concatenated (``[gate; up]``,
      ``is_concatenated``) are split as two packed parts whatever the plan says (inkling2's plan says colwise,
      which would hand one rank all of gate and the other all of up);
    * a per-head ``q_norm`` / ``k_norm`` (weight of head_dim) next to column-split ``q_proj`` / ``k_proj`` sums its
      gradient (``grad_sum``), as Qwen3's plan says and sarvam_moe's omits;
    * an activation with parameters (``act_fn``: apertus' xIELU) between column-split projections likewise.
    """
    out = dict(plan)
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    for glob, style in plan.items():  # concatenated gate_up: packed
        for name in (n for n in params if fnmatch.fnmatchcase(n, glob) and n.endswith("gate_up_proj")):
            owner = modules.get(name.rpartition(".")[0])
            if getattr(owner, "is_concatenated", False) and getattr(owner, "has_gate", True):
                out[glob] = {"colwise": "packed_colwise", "rowwise": "packed_rowwise"}.get(style, style)
    split = {n for n in modules if _style(n, out) in ("colwise", "packed_colwise")}
    parents = {n.rpartition(".")[0] for n in split}
    head_dim = _head_dim(model)
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent not in parents or _style(name, out) is not None or not any(True for _ in module.parameters()):
            continue
        if child in ("q_norm", "k_norm") and f"{parent}.{child[0]}_proj" in split:
            weight = getattr(module, "weight", None)
            if weight is not None and weight.numel() == head_dim:
                out[name] = "replicated_with_grad_allreduce"
        elif child.startswith("act"):
            out[name] = "replicated_with_grad_allreduce"
    return out


def _style(name: str, plan: Mapping[str, str]) -> str | None:
    return next((style for glob, style in plan.items() if fnmatch.fnmatchcase(name, glob)), None)


def _text_config(model: nn.Module):
    config = getattr(model, "config", None)
    return config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config


def _head_dim(model: nn.Module) -> int | None:
    config = _text_config(model)
    head_dim = getattr(config, "head_dim", None)
    heads, hidden = getattr(config, "num_attention_heads", None), getattr(config, "hidden_size", None)
    if not isinstance(head_dim, int) and isinstance(heads, int) and isinstance(hidden, int) and heads:
        head_dim = hidden // heads
    return head_dim


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
    text = _text_config(model)
    attention = [n for n, s in styles.items() if getattr(s, "kind", "") in ("column", "heads")
                 and not s.gather_output and _in_attention(n)]
    if attention:
        heads = _get(text, "num_attention_heads")
        kv = _get(text, "num_key_value_heads") or heads
        # key/value projections split by whole heads (column_heads) may replicate kv heads fewer than the ranks
        by_head = any(styles[n].kind == "heads" for n in attention) and isinstance(kv, int) and tp % kv == 0
        if isinstance(heads, int):
            problems += _heads_problem(f"{type(model).__name__} (num_attention_heads)", heads, tp)
        if isinstance(kv, int) and kv != heads and not by_head:
            problems += _heads_problem(f"{type(model).__name__} (num_key_value_heads)", kv, tp)
        problems += _whole_per_head(model, attention, styles, {heads, kv} - {None})
    return problems


def _in_attention(name: str) -> bool:
    return any(part in ("attn", "self_attn", "attention", "self_attention") or part.endswith("_attn")
               for part in name.split(".")[:-1])


def _get(config, key: str):
    try:
        return getattr(config, key, None)
    except Exception:  # noqa: BLE001 - a per-layer attribute read globally (dots3_note) raises its own error
        return None


def _whole_per_head(model: nn.Module, attention: list[str], styles: Mapping[str, object], heads: set) -> list[str]:
    """A parameter of an attention module whose heads the plan splits, sized by heads, that the plan leaves whole:
    each rank would use all of it with its own heads (Doge's dynamic-mask ``A``; Cohere's ``q_norm`` / ``k_norm``
    with ``use_qk_norm``, a LayerNorm over ``[heads, head_dim]`` that its base plan, written for the default, omits)."""
    problems = []
    for owner in dict.fromkeys(n.rpartition(".")[0] for n in attention):
        module = model.get_submodule(owner)
        for key, param in module.named_parameters(recurse=False):
            name = f"{owner}.{key}"
            if name not in styles and param.dim() >= 1 and param.shape[0] in heads:
                problems.append(f"parameter {name!r} ({tuple(param.shape)}) is per head, and the plan splits the "
                                f"heads of {owner!r} but leaves it whole: add a plan entry that splits it (style "
                                f"'column', with 'local' on {owner!r}), or leave the attention whole")
        for sub, child in module.named_modules():  # a kept submodule's [heads, ...] parameter: the same
            name = f"{owner}.{sub}"
            if not sub or name in styles or any(n.startswith(name + ".") for n in styles):
                continue
            for key, param in child.named_parameters(recurse=False):
                if param.dim() >= 2 and param.shape[0] in heads:
                    problems.append(f"parameter '{name}.{key}' ({tuple(param.shape)}) of {type(child).__name__} is "
                                    f"per head, and the plan splits the heads of {owner!r} but leaves {name!r} "
                                    "whole: each rank would apply every head's part to its own heads -> leave the "
                                    "attention whole (a plan without its projections), or train without tensor "
                                    "parallelism")
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
