"""A transformers causal LM (Llama, Qwen2, Mistral, GPT-2) as an ordered list of layers, for pipeline stages.

``stage_layers(model) -> [Embed, DecoderLayer x L, Head]``: wrappers around the model's own module objects (its
parameters, exactly; nothing copied). Between layers travels one tuple of three tensors: ``hidden [B, S, H]``,
``attention_mask [B, S]`` int64 (``[B, 1]`` when the batch had none: the shape says so without a device sync) and
``position_ids [B, S]`` int64. Each decoder wrapper rebuilds its 4-D mask with the model's own mask function
(causal, or sliding-window per ``config.layer_types`` / Mistral's ``sliding_window``) and its rotary tables with
the model's parameter-free ``rotary_emb`` from the positions: positions are made once, on the first stage, and
travel as int64 (DeepSpeed's pipeline wants a gradient for every floating tensor it sends, so ``(cos, sin)``
cannot travel). The final norm and the head sit on the last layer. Composed on one process the list equals
``model(input_ids, attention_mask=..., position_ids=..., use_cache=False).logits``.

The order comes from the config's ``base_model_pp_plan`` (embeddings, decoder layers, norm) where transformers
has one, with the CausalLM's ``lm_head`` last; GPT-2 has none (``wte + wpe``, ``h``, ``ln_f``).

The wrappers are cached on the model and re-synced on every call: after the tensor-parallel plan swapped
``embed_tokens`` or ``lm_head`` for sharded layers, the wrappers hold the new modules (a stale one would train the
unsharded copy, with correct losses and whole memory).
"""
from __future__ import annotations

import sys
from collections.abc import Mapping

import torch
from torch import nn

from ..errors import PluginError

FAMILIES = ("llama", "qwen2", "mistral", "gpt2")  # the families whose stages this module knows
_CACHE = "_plugin_stage_layers"


def is_hf_model(model) -> bool:
    """A transformers ``PreTrainedModel`` (checked only when transformers is imported: no import cost)."""
    if sys.modules.get("transformers") is None:  # absent, or blocked (a None entry: import would raise)
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def _get(model, path: str):
    for part in path.split("."):
        model = getattr(model, part)
    return model


def _mask_fn(kind: str):
    from transformers import masking_utils as mu

    return mu.create_sliding_window_causal_mask if kind == "sliding_attention" else mu.create_causal_mask


class Embed(nn.Module):
    """Token embeddings (+ GPT-2's learned positions and dropout)."""

    def __init__(self, embed, pos_embed=None, drop=None):
        super().__init__()
        self.embed, self.pos_embed, self.drop = embed, pos_embed, drop

    def forward(self, x):
        input_ids, mask, pos = x
        h = self.embed(input_ids)
        if self.pos_embed is not None:
            h = h + self.pos_embed(pos)
        if self.drop is not None:
            h = self.drop(h)
        return h, mask, pos


class DecoderLayer(nn.Module):
    """One decoder layer; its mask and rotary tables rebuilt from the travelling mask and positions."""

    def __init__(self, layer, config, rotary, mask_kind: str, gpt2: bool):
        super().__init__()
        self.layer = layer
        self.rotary = rotary  # parameter-free and shared by every wrapper (buffers only)
        self._config = (config,)  # a tuple: neither a submodule nor in a state_dict
        self.mask_kind, self.gpt2 = mask_kind, gpt2

    def forward(self, x):
        hidden, mask, pos = x
        config = self._config[0]
        given = None if mask.shape[1] != hidden.shape[1] else mask  # [B, 1]: the batch had no mask
        causal = _mask_fn(self.mask_kind)(config=config, inputs_embeds=hidden, attention_mask=given, cache=None,
                                          position_ids=pos)
        if self.gpt2:
            out = self.layer(hidden, attention_mask=causal, position_ids=pos)  # by name: the order moved in 5.x
        else:
            out = self.layer(hidden, attention_mask=causal, position_embeddings=self.rotary(hidden, pos),
                             position_ids=pos)
        return (out[0] if isinstance(out, tuple) else out), mask, pos


class Head(nn.Module):
    """Final norm and the LM head: the logits."""

    def __init__(self, norm, head):
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, x):
        return self.head(self.norm(x[0]))


def _mask_kind(config, index: int) -> str:
    types = getattr(config, "layer_types", None)
    if types is not None:
        return types[index]
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


def _paths(model) -> tuple[list[tuple[str, str]], list]:
    """``[(wrapper attribute, module path)]`` per layer, and the layer constructors' fixed arguments."""
    config = model.config
    kind = config.model_type
    if kind == "gpt2":
        base = "transformer"
        n = len(model.transformer.h)
        return ([[("embed", f"{base}.wte"), ("pos_embed", f"{base}.wpe"), ("drop", f"{base}.drop")]]
                + [[("layer", f"{base}.h.{i}")] for i in range(n)]
                + [[("norm", f"{base}.ln_f"), ("head", "lm_head")]]), [None] * n
    plan = getattr(config, "base_model_pp_plan", None)
    prefix = getattr(model, "base_model_prefix", "model")
    if kind not in FAMILIES or not plan:
        raise PluginError(f"transformers {kind!r} is not one of {', '.join(FAMILIES)} for pipeline stages -> pass "
                          "your own list of layers (tensor and data parallelism work for it as it is)")
    names = list(plan)
    base = _get(model, prefix)
    if len(names) != 3 or not isinstance(getattr(base, names[1], None), nn.ModuleList):
        raise PluginError(f"transformers {kind!r}: base_model_pp_plan {names} is not [embeddings, decoder layers, norm]"
                          " -> pass your own list of layers")
    outside = [n for n, m in base.named_children() if n not in names and any(True for _ in m.parameters())]
    if outside or not hasattr(model, "lm_head"):
        raise PluginError(f"transformers {kind!r}: {outside or 'no lm_head'} outside its pp plan holds parameters "
                          "-> pass your own list of layers")
    emb, layers, norm = names
    n = len(getattr(base, layers))
    return ([[("embed", f"{prefix}.{emb}")]] + [[("layer", f"{prefix}.{layers}.{i}")] for i in range(n)]
            + [[("norm", f"{prefix}.{norm}"), ("head", "lm_head")]]), [f"{prefix}.rotary_emb"] * n


def stage_layers(model) -> list[nn.Module]:
    """``[Embed, DecoderLayer x L, Head]`` over ``model``'s own modules, cached and re-synced (module docstring)."""
    cached = model.__dict__.get(_CACHE)
    paths, rotary = _paths(model)
    if cached is None:
        config = model.config
        gpt2 = config.model_type == "gpt2"
        first = {a: _get(model, p) for a, p in paths[0]}
        layers = [Embed(**first)]
        for i, (spec, rot) in enumerate(zip(paths[1:-1], rotary, strict=True)):
            layers.append(DecoderLayer(_get(model, spec[0][1]), config, None if rot is None else _get(model, rot),
                                       "full_attention" if gpt2 else _mask_kind(config, i), gpt2))
        layers.append(Head(**{a: _get(model, p) for a, p in paths[-1]}))
        cached = model.__dict__[_CACHE] = tuple(layers)
    for wrapper, spec in zip(cached, paths, strict=True):  # re-sync: the tensor-parallel plan may have swapped modules
        for attr, path in spec:
            now = _get(model, path)
            if getattr(wrapper, attr) is not now:
                setattr(wrapper, attr, now)
    return list(cached)


def first_stage_inputs(inputs) -> tuple:
    """``(input_ids, attention_mask int64 or [B, 1] ones, position_ids [B, S])`` from a tensor or a dict batch."""
    if not isinstance(inputs, Mapping):
        inputs = {"input_ids": inputs}
    extra = sorted(set(inputs) - {"input_ids", "attention_mask", "position_ids", "use_cache"})
    if extra:
        raise PluginError(f"a dict batch holds {extra}: under pipeline stages only input_ids, attention_mask and "
                          "position_ids cross stage boundaries -> drop those keys, or train at pipeline 1")
    ids = inputs["input_ids"]
    rows, seq = ids.shape
    if seq < 2:
        raise PluginError(f"pipeline stages got sequences of length {seq} -> at least 2 tokens per row")
    mask = inputs.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise PluginError(f"pipeline stages take a 2-D attention_mask [batch, seq], not {tuple(mask.shape)}")
    # int64, never bool: DeepSpeed sends bool tensors down a slow special path
    mask = torch.ones(rows, 1, dtype=torch.int64, device=ids.device) if mask is None else (mask != 0).long()
    pos = inputs.get("position_ids")
    pos = (torch.arange(seq, device=ids.device).expand(rows, seq) if pos is None else pos.long().expand(rows, seq))
    return ids, mask, pos.contiguous()
