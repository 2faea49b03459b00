"""The model a user passes to ``initialize`` against its recipe: the dims it can tell, checked for divisibility by
tensor and pipeline and against the recipe's ``model`` block (:func:`check_model`). Pure of torch: it reads
``model.config``, whatever class it is (the reference GPT's :class:`~plugin.models.gpt_config.GPTConfig`,
transformers' configs under their own names).
"""
from __future__ import annotations

from ..errors import WARNING, Problem


def model_dims(model) -> dict:
    """Whatever dims the model can tell: heads, kv_heads, hidden, ffn_hidden, vocab, layers."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return {}
    names = {
        "heads": ("heads", "num_attention_heads", "n_head"),
        "kv_heads": ("kv_heads", "num_key_value_heads"),
        "hidden": ("hidden", "hidden_size", "n_embd"),
        "ffn_hidden": ("ffn_hidden", "intermediate_size", "n_inner"),
        "vocab": ("vocab", "vocab_size"),
        "layers": ("layers", "num_hidden_layers", "n_layer"),
    }
    dims = {}
    for key, candidates in names.items():
        for c in candidates:
            value = getattr(cfg, c, None)
            if isinstance(value, int):
                dims[key] = value
                break
    return dims


def _has_class(model, module: str, name: str) -> bool:
    return any(c.__name__ == name and c.__module__.startswith(module) for c in type(model).__mro__)


def check_recompute(model, recipe, where: str) -> list[Problem]:
    """What the recipe's ``activation_checkpointing`` needs from the model (:mod:`plugin.engines.recompute`)."""
    ac, pp = recipe.activation_checkpointing, recipe.parallelism.pipeline
    hf = _has_class(model, "transformers", "PreTrainedModel")
    if ac.mode == "selective" and not callable(getattr(model, "configure_selective_recompute", None)):
        why = ("transformers picks its attention function per config (eager, sdpa, flash), and the plugin has no "
               "hook into it that replays the tensor-parallel streams yet" if hf else
               "it has no configure_selective_recompute(enabled) that checkpoints its attention core")
        return [Problem("$.activation_checkpointing.mode", f'"selective" recomputes the attention core, but {where} '
                        f"cannot say where that is: {why}",
                        'use "mode": "full" (whole blocks recomputed), or the reference GPT (plugin.models.gpt)')]
    if ac.mode != "full" or pp > 1:
        return []
    if hf and ac.every > 1:
        return [Problem("$.activation_checkpointing.every", f"every {ac.every}: {where} outside pipelines "
                        "checkpoints each decoder layer on its own (its forward passes keyword arguments from "
                        "layer to layer, which a span of layers cannot carry)",
                        'use "every": 1, or pipeline stages (spans of layers inside a stage)')]
    if not (hf or hasattr(model, "to_layers") or _has_class(model, "torch.nn", "Sequential")):
        return [Problem("$.activation_checkpointing", f'"full" recomputes spans of the model\'s layers, and {where} '
                        "is not a list of layers (no to_layers(), not an nn.Sequential)",
                        'pass the model as a list of layers or an nn.Sequential, give it to_layers(), or set '
                        '"mode": "none"')]
    return []


def check_model(model, recipe) -> list[Problem]:
    """The model's real dims against the recipe: divisibility by tensor and pipeline, and the model block."""
    dims = model_dims(model)
    tp, pp = recipe.parallelism.tensor, recipe.parallelism.pipeline
    where = f"model {type(model).__name__}"
    problems = []
    for key in ("heads", "kv_heads", "hidden", "ffn_hidden"):
        if key == "kv_heads" and key in dims and tp % dims[key] == 0 and dims.get("heads", 0) % tp == 0:
            continue  # fewer key/value heads than ranks: a per-head plan holds each on several, others are refused
        if key in dims and dims[key] % tp:
            problems.append(Problem("$.parallelism.tensor", f"{where} has {key} {dims[key]}, not divisible by "
                                    f"tensor {tp}", f"use a tensor size that divides {dims[key]}"))
    on = getattr(model, "is_activation_checkpointing", None)  # transformers 5.24's name; is_gradient_... before
    if on is None:
        on = getattr(model, "is_gradient_checkpointing", False)
    if on is True:  # transformers' own recompute, switched on
        problems.append(Problem("$.activation_checkpointing", f"{where} has transformers' gradient checkpointing on "
                                "(gradient_checkpointing_enable()): it would recompute beside the plugin's and is "
                                "not replayed per tensor-parallel stream",
                                'drop gradient_checkpointing_enable() and set "activation_checkpointing": {"mode": '
                                '"full"} in the recipe: the plugin recomputes each decoder layer (spans of layers '
                                "inside pipeline stages), the tensor-parallel dropout streams replayed, on every "
                                "layout"))
    problems += check_recompute(model, recipe, where)
    if "layers" in dims and dims["layers"] < pp:
        problems.append(Problem("$.parallelism.pipeline", f"{where} has {dims['layers']} layers, fewer than "
                                f"pipeline {pp} stages", f"use pipeline <= {dims['layers']}"))
    if recipe.model is not None:
        for key, value in dims.items():
            declared = getattr(recipe.model, key, None)
            if key == "kv_heads":
                declared = recipe.model.kv_heads_resolved
            if key == "ffn_hidden":
                declared = recipe.model.ffn_hidden_resolved
            if declared is not None and declared != value:
                problems.append(Problem(f"$.model.{key}", f"the recipe says {key} {declared}, {where} has {value}",
                                        f"set {key} to {value} so the checks and estimates describe this model",
                                        WARNING))
    return [p.with_file(recipe.source) for p in problems]
