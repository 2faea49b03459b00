"""Weights tied across pipeline stages on DeepSpeed: the layers holding them become ``TiedLayerSpec`` entries.

DeepSpeed's ``PipelineModule`` (0.19, ``runtime/pipe/module.py``) keeps one module per tie key and stage
(``tied_modules[key]``, built from the first spec of that key on the stage), makes one group per (data, tensor)
coordinate over the stages holding the key (``_index_tied_modules``), broadcasts the ``tied_weight_attr`` tensors from
the lowest rank at construction (``_synchronize_tied_weights``), all-reduces their gradients after backward
(``PipelineEngine._exec_reduce_tied_grads``), and leaves the copies of non-first ranks out of the gradient norm
(``ds_pipe_replicated``).

Here each tie (:class:`plugin.pipeline_parallel.checks.Tie`) gets the key ``tie_<layer indices>``; the first layer
of the tie on each stage becomes a :class:`_ExistingLayer` spec that builds nothing (it returns the layer itself,
so the tied module on the first stage is the embedding layer and on the last the head layer), with
``tied_weight_attr`` the weight's dotted name inside that layer (DeepSpeed resolves dotted names); no ``forward_fn``
is needed, the layer is called as it is. Further holders on the same stage stay plain layers sharing the parameter.

Two fixes around DeepSpeed: its constructor broadcasts the tied weights, which are still on the meta device under
meta init (:func:`synchronize` runs it again once they are real), and it marks *every* parameter of a non-first
rank's tied module ``ds_pipe_replicated`` (for a head layer: the final norm too, which would then be missing from
the gradient norm), on parameters the tensor-parallel plan later replaces: :func:`mark_replicas` marks exactly the
tied weights, after sharding.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from ...errors import PluginError


def key_of(tie) -> str:
    return "tie_" + "_".join(map(str, tie.layers))


def check_ties(ties: Sequence, layers: Sequence[nn.Module]) -> None:
    """A layer holding weights of two ties with different holders cannot be one ``TiedLayerSpec`` (one key each)."""
    keys: dict[int, set[str]] = {}
    for tie in ties:
        for i in tie.layers:
            keys.setdefault(i, set()).add(key_of(tie))
    for i, held in sorted(keys.items()):
        if len(held) > 1:
            raise PluginError(f"{type(layers[i]).__name__} (layer {i}) holds weights tied to different layers "
                              f"({sorted(held)}); DeepSpeed's TiedLayerSpec takes one key per layer -> split the "
                              "layer so that each holds the weights of one tie, or untie them")


def to_specs(layers: Sequence[nn.Module], ties: Sequence, bounds: Sequence[int]) -> list:
    """``layers`` with the first holder of each tie on each stage replaced by a ``TiedLayerSpec`` around it."""
    from deepspeed.pipe import TiedLayerSpec

    class _ExistingLayer(TiedLayerSpec):
        """A TiedLayerSpec whose build returns an existing layer (its class is the layer's, for ``type:`` cuts)."""

        def __init__(self, key, layer, attrs):
            super().__init__(key, type(layer), tied_weight_attr=list(attrs))
            self.layer = layer

        def build(self, log=False):
            return self.layer

    stage_of = {i: s for s in range(len(bounds) - 1) for i in range(bounds[s], bounds[s + 1])}
    names: dict[int, list[str]] = {}
    for tie in ties:
        for i, name in zip(tie.layers, tie.names, strict=True):
            names.setdefault(i, []).append(name)
    out, done = list(layers), set()
    for tie in ties:
        for i in tie.layers:
            if (key_of(tie), stage_of[i]) not in done:
                done.add((key_of(tie), stage_of[i]))
                out[i] = _ExistingLayer(key_of(tie), layers[i], names[i])
    return out


def _tied_params(module):
    for comm in module.tied_comms.values():
        first = dist.get_rank() == comm["ranks"][0]
        for attr in comm["weight_attr"]:
            yield module._recursive_getattr(comm["module"], attr), first


def mark_replicas(module) -> None:
    """``ds_pipe_replicated`` on exactly the tied weights of non-first holders (after the tensor-parallel swap)."""
    for p in module.parameters():
        p.ds_pipe_replicated = False
    for p, first in _tied_params(module):
        p.ds_pipe_replicated = not first


def synchronize(module) -> None:
    """DeepSpeed's broadcast of the tied weights from their first holder, now that they are materialised."""
    module._synchronize_tied_weights()
