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


def check_model(model, recipe) -> list[Problem]:
    """The model's real dims against the recipe: divisibility by tensor and pipeline, and the model block."""
    dims = model_dims(model)
    tp, pp = recipe.parallelism.tensor, recipe.parallelism.pipeline
    where = f"model {type(model).__name__}"
    problems = []
    for key in ("heads", "kv_heads", "hidden", "ffn_hidden"):
        if key in dims and dims[key] % tp:
            problems.append(Problem("$.parallelism.tensor", f"{where} has {key} {dims[key]}, not divisible by "
                                    f"tensor {tp}", f"use a tensor size that divides {dims[key]}"))
    if getattr(model, "is_gradient_checkpointing", False) is True:  # transformers' own recompute, switched on
        field = "$.pipeline_parallel.activation_checkpoint_interval"
        problems.append(Problem(field, f"{where} has transformers' gradient checkpointing on "
                                "(gradient_checkpointing_enable()): it would recompute beside the plugin's and is "
                                "not replayed per tensor-parallel stream",
                                "drop gradient_checkpointing_enable(); the plugin's recompute, with the tensor-"
                                "parallel dropout streams replayed, runs inside pipeline stages: "
                                "pipeline_parallel.activation_checkpoint_interval (none outside pipelines yet)"))
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
