"""transformers causal LMs (Llama, Qwen2, Mistral, GPT-2) built from a recipe's ``model`` block or a local
``config.json``, with random weights (no download, no hub).

The engines call the model with ``use_cache=False`` (dict batches as keyword arguments) and give the loss the
output's ``.logits``; the tensor-parallel ``"auto"`` plan shards these models with whole (gathered) logits, so
their loss is the ordinary cross entropy (see :mod:`plugin.tensor_parallel.hooks`); pipelines cut them at decoder
layers (:mod:`plugin.models.hf_stages`). transformers is an optional dependency (the ``test`` extra).
"""
from __future__ import annotations

import os

from ..errors import PluginError, RecipeError
from .hf_config import FAMILIES, config_problems, family_config, read_config


def _transformers(what: str):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local configs only: never ask the hub
    try:
        import transformers as tf
    except ImportError as e:
        raise PluginError(f"--model {what} needs transformers -> pip install transformers (with torch pinned)") from e
    tf.logging.set_verbosity_error()
    return tf


def build_hf_model(name: str, dims):
    """``name`` a family (:data:`~plugin.models.hf_config.FAMILIES`, sized by ``dims``, a recipe's
    :class:`plugin.recipe.spec.Model`) or the path of a ``config.json`` (or a directory holding one), checked against
    ``dims``: a disagreement raises :class:`RecipeError` naming both values."""
    if name in FAMILIES:
        tf = _transformers(name)
        model_type, kwargs = family_config(name, dims)
        config = tf.AutoConfig.for_model(model_type, **kwargs)
    else:
        data = read_config(name)
        problems = config_problems(data, dims, f"{name}")
        if any(p.is_error for p in problems):
            raise RecipeError(problems)
        tf = _transformers(name)
        data = {k: v for k, v in data.items() if k not in ("architectures", "transformers_version")}
        config = tf.AutoConfig.for_model(data.pop("model_type"), **data)
        config.use_cache = False
    return tf.AutoModelForCausalLM.from_config(config)
