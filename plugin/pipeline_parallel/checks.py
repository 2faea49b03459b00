"""What must hold of a layer list before it is cut into pipeline stages, for every pipelined back end.

The cut itself is pure arithmetic (:func:`plugin.pipeline_parallel.stages.stage_bounds`); this is its torch side:
counting the layers' parameters for the cut, and refusing a parameter that two stages would hold. Each stage keeps
its own layers on its own ranks, so a weight tied across stages (the reference GPT's ``tie_embeddings``:
embedding and head) would become two copies trained apart, silently. Neither DeepSpeed's PipelineModule
(given plain modules, not its TiedLayerSpec) nor torch.distributed.pipelining keeps them tied.
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..errors import PluginError
from .stages import stage_bounds


def cut_layers(layers: Sequence[nn.Module], method: str, num_stages: int) -> list[int]:
    """The stage boundaries of ``layers`` under a recipe's partition method, counted as DeepSpeed counts
    them: class names for ``type:``, trainable parameters (before any tensor-parallel sharding) for
    ``parameters``."""
    counts = [sum(p.numel() for p in layer.parameters() if p.requires_grad) for layer in layers]
    return stage_bounds(method, [type(layer).__name__ for layer in layers], counts, num_stages)


def shared_across_stages(layers: Sequence[nn.Module], bounds: Sequence[int]) -> list[str]:
    """``"Layer (layer i).name"`` for each parameter held by a layer on a later stage than its first holder."""
    owner: dict[int, int] = {}
    clashes = []
    for s in range(len(bounds) - 1):
        for i in range(bounds[s], bounds[s + 1]):
            for name, p in layers[i].named_parameters():
                if owner.setdefault(id(p), s) != s:
                    clashes.append(f"{type(layers[i]).__name__} (layer {i}).{name}")
    return clashes


def check_shared_across_stages(layers: Sequence[nn.Module], bounds: Sequence[int], trainer: str) -> None:
    """Raise :class:`PluginError` naming the parameters two stages would hold; ``trainer`` names what would
    train the copies apart (``"DeepSpeed's PipelineModule"``)."""
    clashes = shared_across_stages(layers, bounds)
    if clashes:
        raise PluginError(f"parameters shared by layers on different pipeline stages: {', '.join(clashes[:4])}; "
                          f"{trainer} would train two copies apart -> untie them (for the reference GPT: "
                          "tie_embeddings false), or use a partition that keeps them together")


def check_stage_cut(layers: Sequence[nn.Module], method: str, num_stages: int, trainer: str) -> list[int]:
    """The stage boundaries of ``layers`` (:func:`cut_layers`), refused by :func:`check_shared_across_stages` when two
    stages would hold one parameter. Pure of process groups: both pipelined back ends call it before they create
    any, so every rank refuses alike and none is left waiting in a collective."""
    bounds = cut_layers(layers, method, num_stages)
    check_shared_across_stages(layers, bounds, trainer)
    return bounds
