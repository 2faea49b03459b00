"""What must hold of a layer list before it is cut into pipeline stages, for every pipelined back end.

The cut itself is pure arithmetic (:func:`plugin.pipeline_parallel.stages.stage_bounds`); this is its torch side:
counting the layers' parameters for the cut, and finding the parameters two stages hold. Each stage keeps its own
layers on its own ranks, so a weight tied across stages (the reference GPT's ``tie_embeddings``, GPT-2's
``tie_word_embeddings``: embedding and head) becomes one copy per stage. :func:`ties_across_stages` lists them
(:class:`Tie`); the back ends keep the copies equal (Megatron's embedding group): the same values at start (a
broadcast from the first holder), the gradients summed over the holding stages' ranks before the optimizer step, and
counted once in the gradient norm. DeepSpeed does it through its ``TiedLayerSpec``
(:mod:`plugin.engines.deepspeed.tied`), the native back end over the groups of
:func:`plugin.distributed.groups.build_tie_groups` (:mod:`plugin.engines.native.tied`). What neither can do is
refused here, before any process group exists: two stages of one tie on the same rank (interleaved schedules).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from ..errors import PluginError
from .stages import stage_bounds


def cut_layers(layers: Sequence[nn.Module], method: str, num_stages: int) -> list[int]:
    """The stage boundaries of ``layers`` under a recipe's partition method, counted as DeepSpeed counts
    them: class names for ``type:``, trainable parameters (before any tensor-parallel sharding) for
    ``parameters``."""
    counts = [sum(p.numel() for p in layer.parameters() if p.requires_grad) for layer in layers]
    return stage_bounds(method, [type(layer).__name__ for layer in layers], counts, num_stages)



@dataclass(frozen=True)
class Tie:
    """One parameter held by layers of more than one stage: ``layers`` (indices in the layer list, in order),
    ``names`` (its name inside each of those layers), ``stages`` (the distinct stages holding it, sorted)."""

    layers: tuple[int, ...]
    names: tuple[str, ...]
    stages: tuple[int, ...]

    def ranks(self, pipeline: int) -> tuple[int, ...]:
        """The pipeline ranks holding a copy (stage ``s`` sits on pipeline rank ``s % pipeline``), sorted."""
        return tuple(sorted({s % pipeline for s in self.stages}))


def ties_across_stages(layers: Sequence[nn.Module], bounds: Sequence[int]) -> list[Tie]:
    """Every parameter that layers of two or more stages hold, in the order of its first holder."""
    stage_of = {i: s for s in range(len(bounds) - 1) for i in range(bounds[s], bounds[s + 1])}
    found: dict[int, list[tuple[int, str]]] = {}
    for i in range(bounds[0], bounds[-1]):
        seen = set()
        for name, p in layers[i].named_parameters(remove_duplicate=False):
            if id(p) not in seen:
                seen.add(id(p))
                found.setdefault(id(p), []).append((i, name))
    ties = []
    for holders in found.values():
        stages = sorted({stage_of[i] for i, _ in holders})
        if len(stages) > 1:
            ties.append(Tie(tuple(i for i, _ in holders), tuple(n for _, n in holders), tuple(stages)))
    return ties


def check_ties(ties: Sequence[Tie], layers: Sequence[nn.Module], pipeline: int, trainer: str) -> None:
    """Refuse a tie that two stages of one rank would hold (interleaved schedules): each rank keeps one copy."""
    for tie in ties:
        if len(tie.ranks(pipeline)) < len(tie.stages):
            where = ", ".join(f"{type(layers[i]).__name__} (layer {i}).{n}"
                              for i, n in zip(tie.layers, tie.names, strict=True))
            raise PluginError(f"a weight tied across pipeline stages {list(tie.stages)} ({where}) would sit twice on "
                              f"one pipeline rank of {pipeline}; {trainer} keeps one copy per rank -> use a schedule "
                              "without virtual stages, a partition that puts its holders on different ranks, or untie "
                              "it (for the reference GPT: tie_embeddings false)")


def check_stage_cut(layers: Sequence[nn.Module], method: str, num_stages: int, trainer: str,
                    pipeline: int | None = None) -> tuple[list[int], list[Tie]]:
    """The stage boundaries of ``layers`` (:func:`cut_layers`) and the weights tied across them
    (:func:`ties_across_stages`), refused by :func:`check_ties`. ``pipeline``: the pipeline ranks (``num_stages`` when
    each holds one stage). Pure of process groups: both pipelined back ends call it before they create any, so every
    rank refuses alike and none is left waiting in a collective."""
    bounds = cut_layers(layers, method, num_stages)
    ties = ties_across_stages(layers, bounds)
    check_ties(ties, layers, pipeline or num_stages, trainer)
    return bounds, ties
