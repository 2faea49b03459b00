"""The recipe's ``model`` block <-> a transformers config (Llama, Qwen2, Mistral, GPT-2), without torch.

:func:`family_config` sizes a family from the recipe (the config's ``model_type`` and keyword arguments);
:func:`config_problems` compares a ``config.json`` with the recipe and names both values where they disagree.
train.py refuses those problems before any process group exists; ``plugin.initialize`` warns about the same
dims (:mod:`plugin.engines.model_checks`).
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import WARNING, PluginError, Problem

FAMILIES = ("llama", "qwen2", "mistral", "gpt2")

# recipe field -> the config key per naming scheme ("rope": llama / qwen2 / mistral; "gpt2")
FIELDS = {
    "layers": {"rope": "num_hidden_layers", "gpt2": "n_layer"},
    "hidden": {"rope": "hidden_size", "gpt2": "n_embd"},
    "heads": {"rope": "num_attention_heads", "gpt2": "n_head"},
    "kv_heads": {"rope": "num_key_value_heads", "gpt2": None},
    "ffn_hidden": {"rope": "intermediate_size", "gpt2": "n_inner"},
    "vocab": {"rope": "vocab_size", "gpt2": "vocab_size"},
    "seq_len": {"rope": "max_position_embeddings", "gpt2": "n_positions"},
}


def _scheme(model_type: str) -> str:
    return "gpt2" if model_type == "gpt2" else "rope"


def family_config(family: str, dims) -> tuple[str, dict]:
    """``(model_type, config kwargs)`` for ``family`` sized by ``dims`` (a recipe's :class:`~plugin.recipe.spec.Model`):
    random weights, untied heads for the rope families (their defaults), tied GPT-2 (its own), no KV cache, EOS 0
    (the byte-level EOS), no sliding window (the recipe has no such field)."""
    if family not in FAMILIES:
        raise PluginError(f"unknown model family {family!r} -> use gpt, {', '.join(FAMILIES)} or a config.json path")
    common = dict(vocab_size=dims.vocab, bos_token_id=0, eos_token_id=0, use_cache=False)
    if family == "gpt2":
        return family, dict(common, n_embd=dims.hidden, n_layer=dims.layers, n_head=dims.heads,
                            n_inner=dims.ffn_hidden_resolved, n_positions=dims.seq_len, resid_pdrop=dims.dropout,
                            embd_pdrop=dims.dropout, attn_pdrop=dims.dropout)
    kwargs = dict(common, hidden_size=dims.hidden, num_hidden_layers=dims.layers, num_attention_heads=dims.heads,
                  num_key_value_heads=dims.kv_heads_resolved, intermediate_size=dims.ffn_hidden_resolved,
                  max_position_embeddings=dims.seq_len, attention_dropout=dims.dropout, tie_word_embeddings=False)
    if family == "mistral":
        kwargs["sliding_window"] = None
    if family == "qwen2":
        kwargs["use_sliding_window"] = False
    return family, kwargs


def read_config(path) -> dict:
    """A ``config.json`` (or a directory holding one) as a dict, with a clear error when missing or unreadable."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise PluginError(f"--model {path}: no such config file -> give gpt, {', '.join(FAMILIES)}, or the path of a "
                          "config.json (or of a directory holding one)")
    try:
        data = json.loads(p.read_text())
    except ValueError as e:
        raise PluginError(f"{p}: not JSON ({e})") from e
    if data.get("model_type") not in FAMILIES:
        raise PluginError(f"{p}: model_type {data.get('model_type')!r} is not one of {', '.join(FAMILIES)}")
    return data


def config_problems(config: dict, dims, source: str) -> list[Problem]:
    """Every disagreement between ``config`` (a config.json's dict) and the recipe's ``dims``, each naming both values.

    Equal dims are required but for ``seq_len``: the recipe may train shorter than the config's maximum; dropout
    and GPT-2's missing grouped-query heads are warnings (they change neither shapes nor estimates)."""
    scheme = _scheme(config["model_type"])
    problems = []
    for field, keys in FIELDS.items():
        key = keys[scheme]
        recipe_value = getattr(dims, field)
        if key is None:  # GPT-2 has no kv heads: the recipe's (if set) must equal heads
            if recipe_value is not None and recipe_value != dims.heads:
                problems.append(Problem(f"$.model.{field}", f"the recipe says kv_heads {recipe_value}, but {source} is "
                                        "GPT-2, which has no grouped-query attention",
                                        "drop model.kv_heads or set it to model.heads"))
            continue
        value = config.get(key)
        note = ""
        if field == "kv_heads":
            value = config.get("num_attention_heads") if value is None else value
            recipe_value = dims.kv_heads_resolved
            note = "" if dims.kv_heads is not None else " (heads, since kv_heads is not set)"
        if field == "ffn_hidden":
            if value is None and scheme == "gpt2":
                value = 4 * config.get("n_embd", 0)
            recipe_value = dims.ffn_hidden_resolved
            note = "" if dims.ffn_hidden is not None else " (4 x hidden, since ffn_hidden is not set)"
        if field == "seq_len":
            if value is not None and recipe_value > value:
                problems.append(Problem("$.model.seq_len", f"the recipe says seq_len {recipe_value}, but {source} says "
                                        f"{key} {value}", f"set model.seq_len to at most {value}"))
            continue
        if value != recipe_value:
            problems.append(Problem(f"$.model.{field}", f"the recipe says {field} {recipe_value}{note}, but {source} "
                                    f"says {key} {value}",
                                    f"set model.{field} to {value} in the recipe, or use a config with {key} "
                                    f"{recipe_value}"))
    dropout_key = "attention_dropout" if scheme == "rope" else "resid_pdrop"
    if config.get(dropout_key, 0.0) != dims.dropout:
        problems.append(Problem("$.model.dropout", f"the recipe says dropout {dims.dropout}, but {source} says "
                                f"{dropout_key} {config.get(dropout_key, 0.0)}",
                                "the config's value trains; set model.dropout to match", WARNING))
    return problems
