"""Any transformers causal LM built from a recipe's ``model`` block (``--model NAME``, a ``model_type``) or a local
``config.json`` (``--model DIR``), with random weights (no download, no hub).

``NAME`` is any ``model_type`` that ``AutoConfig`` builds and ``AutoModelForCausalLM`` maps; the family's defaults are
sized by the recipe (:func:`plugin.models.hf_config.size_config`), and the result is checked against the recipe
again (a family without a key for a recipe field, e.g. GPT-2's grouped-query heads, is refused naming both). A
multimodal ``model_type`` whose text model is itself a causal LM (gemma3 -> gemma3_text) builds that text model.

The engines call the model with ``use_cache=False`` (dict batches as keyword arguments) and give the loss the
output's ``.logits``; the tensor-parallel ``"auto"`` plan shards these models with whole (gathered) logits, so
their loss is the ordinary cross entropy (see :mod:`plugin.tensor_parallel.hooks`); pipelines cut them at decoder
layers (:mod:`plugin.models.hf_stages`). transformers is an optional dependency (the ``test`` extra).
"""
from __future__ import annotations

import difflib
import os

from ..errors import PluginError, RecipeError
from .hf_config import config_problems, read_config, size_config


def _transformers(what: str):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local configs only: never ask the hub
    try:
        import transformers as tf
    except ImportError as e:
        raise PluginError(f"--model {what} needs transformers -> pip install transformers (with torch pinned)") from e
    tf.logging.set_verbosity_error()
    return tf


def causal_lm_types() -> list[str]:
    """Every ``model_type`` of the installed transformers that ``AutoModelForCausalLM`` maps."""
    tf = _transformers("NAME")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t in tf.CONFIG_MAPPING)


def config_class(model_type: str, what: str):
    """The config class of a causal-LM ``model_type``; refuses any other, naming close ones."""
    tf = _transformers(what)
    types = causal_lm_types()
    if model_type not in types:
        close = difflib.get_close_matches(model_type, types, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}?" if close else f"one of the {len(types)} causal-LM model types of " \
            f"transformers {tf.__version__} (llama, qwen3, gemma2, mixtral, ...)"
        raise PluginError(f"--model {what}: {model_type!r} is not a causal LM that AutoModelForCausalLM builds -> "
                          f"use gpt, {hint}, or a config.json path")
    return tf.CONFIG_MAPPING[model_type]


def _text_model_type(defaults: dict) -> str | None:
    text = defaults.get("text_config")
    return text.get("model_type") if isinstance(text, dict) else None


def family_config(model_type: str, dims, *, experts: tuple[int, int] | None = None):
    """The config of family ``model_type`` sized by ``dims`` (see :mod:`plugin.models.hf_config`), checked against
    ``dims`` again; raises :class:`PluginError` naming the family and the reason when it cannot be sized."""
    cls = config_class(model_type, model_type)
    try:
        defaults = cls().to_dict()
    except Exception as e:  # a config class whose own defaults do not validate
        raise PluginError(f"--model {model_type}: its config class {cls.__name__} cannot be built from its defaults "
                          f"({type(e).__name__}: {str(e).strip().splitlines()[-1]}) -> give a config.json") from e
    text_type = _text_model_type(defaults)
    if text_type is not None:
        if text_type not in causal_lm_types():
            raise PluginError(f"--model {model_type}: a multimodal family whose text model {text_type!r} is not a "
                              "causal LM of its own -> give a config.json of a text-only causal LM")
        return family_config(text_type, dims, experts=experts)
    kwargs = size_config(defaults, dims, cls.attribute_map, experts=experts)
    try:
        config = cls(**kwargs)
    except Exception as e:
        raise PluginError(f"--model {model_type}: {cls.__name__} refuses the recipe's sizes ({type(e).__name__}: "
                          f"{str(e).strip().splitlines()[-1]}) -> change the recipe's model block, or give a "
                          "config.json") from e
    problems = [p for p in config_problems(config.to_dict(), dims, f"the {model_type} family", cls.attribute_map)
                if p.is_error]
    if problems:
        raise RecipeError(problems)
    return config


def _config_from_file(path: str, dims):
    data = read_config(path)
    cls = config_class(data["model_type"], path)
    if isinstance(data.get("text_config"), dict):
        raise PluginError(f"--model {path}: model_type {data['model_type']!r} is multimodal -> give a config.json of "
                          f"its text model (its text_config, model_type {_text_model_type(data)!r})")
    problems = config_problems(data, dims, f"{path}", cls.attribute_map)
    if any(p.is_error for p in problems):
        raise RecipeError(problems)
    data = {k: v for k, v in data.items() if k not in ("architectures", "transformers_version", "model_type")}
    config = cls(**data)
    config.use_cache = False
    return config


def build_hf_model(name: str, dims):
    """``name`` a causal-LM ``model_type`` (sized by ``dims``, a recipe's :class:`plugin.recipe.spec.Model`) or the
    path of a ``config.json`` (or a directory holding one), checked against ``dims``: a disagreement raises
    :class:`RecipeError` naming both values."""
    is_path = os.sep in name or os.path.exists(name)
    config = _config_from_file(name, dims) if is_path else family_config(name, dims)
    tf = _transformers(name)
    return tf.AutoModelForCausalLM.from_config(config)
