"""The table of ``python -m plugin elastic``: at each node count of an elastic range, what the recipe trains.

DeepSpeed's Elasticity listed the GPU counts at which a data-parallel job keeps its global batch; this does it for
3-D layouts, with the planner's memory per GPU and step time at each. Pure: no torch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..recipe.elastic import layout_at, usable_world
from ..recipe.layout import Layout
from .for_recipe import estimate_recipe


@dataclass(frozen=True)
class ElasticRow:
    """One node count: its processes, how many of them train (``usable``), the layout there and its estimate."""

    nodes: int
    world_size: int
    usable: int | None
    layout: Layout | None
    memory_per_gpu: float | None  # bytes, the most loaded rank
    step_time_s: float | None
    fits: bool | None

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["layout"] = None if self.layout is None else dataclasses.asdict(self.layout)
        return out


def elastic_table(recipe, nodes: range, gpus_per_node: int, gpu_memory: float | None = None) -> list[ElasticRow]:
    """A row per node count in ``nodes`` (``gpus_per_node`` processes each); estimates need the recipe's model."""
    rows = []
    for n in nodes:
        world = n * gpus_per_node
        usable = usable_world(recipe, world)
        layout = None if usable is None else layout_at(recipe, usable)
        memory = step = fits = None
        if layout is not None and recipe.model is not None:
            est = estimate_recipe(recipe, world_size=usable, gpu_memory=gpu_memory)
            memory, step, fits = est.memory.total, est.time.total, est.fits
        rows.append(ElasticRow(n, world, usable, layout, memory, step, fits))
    return rows
