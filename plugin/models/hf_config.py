"""The recipe's ``model`` block <-> the config of any transformers causal LM, as plain dicts (no torch, nor
transformers).

A family's config is read through its own key names: ``attribute_map`` (the config class's, e.g. GPT-2's
``{"hidden_size": "n_embd", ...}``) turns the standard names below into the family's. :func:`size_config` writes the
recipe's dims into a family's defaults (``config_class().to_dict()``) and fixes the keys derived from them by rule
(:data:`RULES`, one rule per pattern, not per family); :func:`config_problems` compares a config with the recipe and
names both values where they disagree. :mod:`plugin.models.hf` does the transformers side (which class, building,
checking that the sizing stuck). train.py refuses those problems before any process group exists;
``plugin.initialize`` warns about the same dims (:mod:`plugin.engines.model_checks`).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import WARNING, PluginError, Problem

# recipe field -> the standard config names that may hold it, first found wins (then the family's attribute_map)
KEYS = {
    "layers": ("num_hidden_layers", "num_layers"),
    "hidden": ("hidden_size",),
    "heads": ("num_attention_heads",),
    "kv_heads": ("num_key_value_heads", "num_kv_heads"),
    "ffn_hidden": ("intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim", "moe_intermediate_size"),
    "vocab": ("vocab_size",),
    "seq_len": ("max_position_embeddings",),
}

# What size_config fixes besides the recipe's dims, each a pattern some families share (docs/tensor-parallel.md lists
# them):
# keys derived from the dims that a family's defaults would leave inconsistent.
RULES = {
    "head_dim": "head_dim (and every other *_head_dim) = hidden / heads, but in latent attention, where head_dim is "
                "the family's own (DeepSeek's: its rope dim)",
    "mla": "latent attention (kv_lora_rank present): qk_head_dim = v_head_dim = hidden / heads, its halves "
           "qk_rope_head_dim and qk_nope_head_dim, kv_lora_rank = hidden / 4; head_dim stays whichever of them it "
           "was; one key/value head per attention head",
    "rotary_dim": "rotary_dim keeps its fraction of the head dim",
    "ffn": "every other *intermediate_size / *ffn_hidden_size keeps its ratio to the dense one (a multiple of 8)",
    "vocabularies": "unpadded_vocab_size and vocab_size_per_layer_input = vocab",
    "lora_ranks": "every *_lora_rank = hidden / 2 (but kv_lora_rank, see mla)",
    "token_ids": "bos and eos 0 (the byte-level EOS); any other *_token_id outside the vocabulary None",
    "layer_lists": "per-layer lists (layer_types, mlp_layer_types, ...) cut to the first `layers` entries, keeping "
                   "one layer of every kind the family's list has (from the end)",
    "dense_prefix": "counts of leading dense or KV-sharing layers (first_k_dense_replace, num_dense_layers, "
                    "num_kv_shared_layers) at most layers minus the kinds of layer_types (1 without), so each kind "
                    "of layer stays",
    "dropout": "every *dropout / *pdrop probability and *jitter_noise (router noise) = the recipe's dropout",
    "per_layer": "per_layer_config overrides sized by the same rules (for the layers that remain)",
    "index_heads": "an indexer's query heads taken from one key/value head (index_num_heads, Kolibri's) at most "
                   "heads / kv_heads",
    "cache": "use_cache False",
    "experts": "with experts=(E, k): at most E experts (routed and local), top-k at most k, one routing group, at "
               "most one shared expert (counts the family's defaults leave None: E, k, 1, and ffn_hidden wide)",
}

_MLA = ("qk_nope_head_dim", "v_head_dim", "qk_rope_head_dim", "qk_head_dim")
_FFN_EXTRA = re.compile(r"(intermediate_size|ffn_hidden_size|ffn_dim)$")
_DROPOUT = re.compile(r"(dropout|pdrop|dropout_prob|dropout_rate|jitter_noise)$")
_OTHER_VOCABS = ("unpadded_vocab_size", "vocab_size_per_layer_input")
_DENSE_PREFIX = ("first_k_dense_replace", "num_dense_layers", "num_kv_shared_layers")
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k_experts")
_SHARED_EXPERTS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
_GROUPS = ("n_group", "topk_group", "num_expert_group")


def key_of(field: str, config: dict, attribute_map: dict | None = None) -> str | None:
    """The key of ``config`` (a family's dict) that holds recipe ``field``, or None when the family has none."""
    attribute_map = attribute_map or {}
    for name in KEYS[field]:
        key = attribute_map.get(name, name)
        if key in config:
            return key
    return None


def _even(n: float) -> int:
    return max(2, int(round(n / 2)) * 2)


def _multiple_of_8(n: float) -> int:
    return max(8, int(round(n / 8)) * 8)


def _cut_layers(values: list, n: int) -> list:
    """The first ``n`` entries, then every kind the whole list has but the cut lost, put back from the end."""
    cut = list(values[:n]) if len(values) >= n else [values[i % len(values)] for i in range(n)]
    missing = [v for v in dict.fromkeys(values) if v not in cut]
    slot = n - 1
    for v in missing:
        while slot >= 0 and cut.count(cut[slot]) == 1:  # never remove the last of a kind
            slot -= 1
        if slot < 0:
            break
        cut[slot] = v
        slot -= 1
    return cut


def size_config(defaults: dict, dims, attribute_map: dict | None = None, *,
                experts: tuple[int, int] | None = None) -> dict:
    """The keyword arguments that size a family (``defaults``: its config class's ``to_dict()``) by ``dims``
    (a recipe's :class:`~plugin.recipe.spec.Model`): the recipe's dims under the family's own key names, then the
    derived keys of :data:`RULES`. Only keys the family has are written; the rest stays the family's default.
    ``experts=(E, k)`` also caps a mixture of experts (tests use it for tiny models)."""
    d, out = defaults, {}
    n = dims.layers
    head_dim = dims.hidden // dims.heads
    values = {"layers": n, "hidden": dims.hidden, "heads": dims.heads, "kv_heads": dims.kv_heads_resolved,
              "ffn_hidden": dims.ffn_hidden_resolved, "vocab": dims.vocab, "seq_len": dims.seq_len}
    for field, value in values.items():
        key = key_of(field, d, attribute_map)
        if key is not None:
            out[key] = value
    ffn_key = key_of("ffn_hidden", d, attribute_map)
    dense_ffn = d.get(ffn_key) if ffn_key else None
    hidden_key = key_of("hidden", d, attribute_map)
    heads_key = key_of("heads", d, attribute_map)
    old_head_dim = (d.get("head_dim") or (d[hidden_key] // d[heads_key] if hidden_key and heads_key
                                           and isinstance(d.get(heads_key), int) and d[heads_key] else None))
    mla = "kv_lora_rank" in d
    kinds = len(set(d["layer_types"])) if isinstance(d.get("layer_types"), list) and d["layer_types"] else 1
    for key, value in d.items():
        if key in out:
            continue
        if key == "head_dim" and not mla and (value is None or isinstance(value, int)):
            out[key] = head_dim  # None too: some families' defaults leave it None and then read it
        elif key.endswith("head_dim") and key not in _MLA and key != "head_dim" and isinstance(value, int):
            out[key] = head_dim
        elif key == "rotary_dim" and isinstance(value, int) and old_head_dim:
            out[key] = min(head_dim, _even(head_dim * value / old_head_dim))
        elif _FFN_EXTRA.search(key) and isinstance(value, int) and not isinstance(value, bool) and dense_ffn:
            out[key] = _multiple_of_8(dims.ffn_hidden_resolved * value / dense_ffn)
        elif _DROPOUT.search(key) and isinstance(value, float):
            out[key] = dims.dropout
        elif key in _OTHER_VOCABS and isinstance(value, int):
            out[key] = dims.vocab
        elif key.endswith("_lora_rank") and isinstance(value, int):
            out[key] = dims.hidden // 2
        elif key.endswith("_token_id") and isinstance(value, int) and value >= dims.vocab:
            out[key] = None
        elif isinstance(value, list) and len(value) == d.get(key_of("layers", d, attribute_map) or "", -1) \
                and all(isinstance(v, (str, int, bool)) for v in value):
            out[key] = _cut_layers(value, n)
        elif key in _DENSE_PREFIX and isinstance(value, int) and value > 0:
            out[key] = min(value, max(n - kinds, 0))
        elif key == "index_num_heads" and isinstance(value, int):
            out[key] = max(1, min(value, dims.heads // dims.kv_heads_resolved))
    if mla:
        rope = _even(head_dim / 2)
        new = {"qk_nope_head_dim": head_dim - rope, "v_head_dim": head_dim, "qk_rope_head_dim": rope,
               "qk_head_dim": head_dim}
        old = {k: d.get(k) for k in new}
        out.update({k: v for k, v in new.items() if k in d})
        out["kv_lora_rank"] = dims.hidden // 4
        if "head_dim" in d:  # whichever latent dim it was (DeepSeek's is its rope dim), else hidden / heads
            same = [k for k, v in old.items() if v is not None and v == d["head_dim"]]
            out["head_dim"] = new[same[0]] if same else head_dim
    if experts is not None:
        count, top = experts
        names = lambda keys: dict.fromkeys((attribute_map or {}).get(k, k) for k in keys)  # noqa: E731
        for key in names(_EXPERT_COUNTS):
            if key in d and (d[key] is None or isinstance(d[key], int) and d[key] > count):
                out[key] = count
        for key in names(_TOP_K):
            if key in d and (d[key] is None or isinstance(d[key], int) and d[key] > top):
                out[key] = top
        for key in names(_SHARED_EXPERTS):
            if key in d and (d[key] is None or isinstance(d[key], int) and d[key] > 1):
                out[key] = 1
        if "moe_intermediate_size" in d and d["moe_intermediate_size"] is None:
            out["moe_intermediate_size"] = dims.ffn_hidden_resolved
        for key in _GROUPS:
            if isinstance(d.get(key), int) and d[key] > 1:
                out[key] = 1
    if isinstance(d.get("per_layer_config"), dict):  # per-layer overrides, sized alike (layers that remain)
        per = {}
        for index, sub in d["per_layer_config"].items():
            if isinstance(sub, dict) and str(index).isdigit() and int(index) < n:
                sized = size_config({**d, **sub, "per_layer_config": None}, dims, attribute_map, experts=experts)
                per[index] = {k: sized.get(k, v) for k, v in sub.items()}
        out["per_layer_config"] = per
    out.update(bos_token_id=0, eos_token_id=0, use_cache=False)
    return out


def read_config(path) -> dict:
    """A ``config.json`` (or a directory holding one) as a dict, with a clear error when missing or unreadable."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise PluginError(f"--model {path}: no such config file -> give gpt, a transformers model_type (llama, "
                          "qwen3, ...), or the path of a config.json (or of a directory holding one)")
    try:
        data = json.loads(p.read_text())
    except ValueError as e:
        raise PluginError(f"{p}: not JSON ({e})") from e
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise PluginError(f"{p}: no model_type -> a transformers config.json names its model_type (llama, qwen3, ...)")
    return data


def config_problems(config: dict, dims, source: str, attribute_map: dict | None = None) -> list[Problem]:
    """Every disagreement between ``config`` (a config.json's dict) and the recipe's ``dims``, each naming both values.

    Equal dims are required but for ``seq_len``: the recipe may train shorter than the config's maximum. A recipe
    field the family has no key for is an error when it cannot hold (kv_heads other than heads), else a warning
    (the recipe's ffn_hidden unchecked); dropout is a warning (it changes neither shapes nor estimates)."""
    problems = []
    for field in KEYS:
        key = key_of(field, config, attribute_map)
        recipe_value = getattr(dims, field)
        value = config.get(key) if key else None
        note = ""
        if field == "kv_heads":
            if key is None:  # no grouped-query attention in this family: the recipe's (if set) must equal heads
                if recipe_value is not None and recipe_value != dims.heads:
                    problems.append(Problem("$.model.kv_heads", f"the recipe says kv_heads {recipe_value}, but "
                                            f"{source} ({config['model_type']}) has no grouped-query attention",
                                            "drop model.kv_heads or set it to model.heads"))
                continue
            value = config.get(key_of("heads", config, attribute_map)) if value is None else value
            recipe_value = dims.kv_heads_resolved
            note = "" if dims.kv_heads is not None else " (heads, since kv_heads is not set)"
        if field == "ffn_hidden":
            hidden = config.get(key_of("hidden", config, attribute_map) or "")
            if value is None and key in ("n_inner", None) and isinstance(hidden, int):
                value = 4 * hidden  # GPT-2 style: None means 4 x hidden
            recipe_value = dims.ffn_hidden_resolved
            note = "" if dims.ffn_hidden is not None else " (4 x hidden, since ffn_hidden is not set)"
            if key is None:
                problems.append(Problem("$.model.ffn_hidden", f"{source} ({config['model_type']}) has no MLP width "
                                        f"key ({', '.join(KEYS['ffn_hidden'])}): the recipe's ffn_hidden "
                                        f"{recipe_value}{note} is not checked against it",
                                        "check the family's MLP width yourself", WARNING))
                continue
        if field == "seq_len":
            if value is not None and recipe_value > value:
                problems.append(Problem("$.model.seq_len", f"the recipe says seq_len {recipe_value}, but {source} says "
                                        f"{key} {value}", f"set model.seq_len to at most {value}"))
            continue
        if key is None:
            problems.append(Problem(f"$.model.{field}", f"the recipe says {field} {recipe_value}, but {source} "
                                    f"({config['model_type']}) has none of {', '.join(KEYS[field])}",
                                    "use a config that has it, or the reference GPT (--model gpt)"))
            continue
        if field == "kv_heads" and "kv_lora_rank" in config and recipe_value != dims.heads:
            problems.append(Problem("$.model.kv_heads", f"the recipe says kv_heads {recipe_value}{note}, but {source} "
                                    f"({config['model_type']}) has latent attention (kv_lora_rank): one key/value head "
                                    "per attention head", f"set model.kv_heads to model.heads ({dims.heads})"))
            continue
        if isinstance(value, list) and value and all(v == recipe_value for v in value):
            value = recipe_value  # a per-layer list (gemma3n's intermediate_size), the same on every layer
        if value != recipe_value:
            problems.append(Problem(f"$.model.{field}", f"the recipe says {field} {recipe_value}{note}, but {source} "
                                    f"says {key} {value}",
                                    f"set model.{field} to {value} in the recipe, or use a config with {key} "
                                    f"{recipe_value}"))
    for key, value in config.items():
        if _DROPOUT.search(key) and isinstance(value, float) and value != dims.dropout:
            problems.append(Problem("$.model.dropout", f"the recipe says dropout {dims.dropout}, but {source} says "
                                    f"{key} {value}", "the config's value trains; set model.dropout to match",
                                    WARNING))
            break
    return problems
