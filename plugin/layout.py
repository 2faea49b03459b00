"""Resolve a recipe's sizes: the data degree (``"auto"``), the world size and the batch triple.

``global = micro x grad_accum x data``: any two given, the third derived; with only ``micro`` or only
``global`` given, ``grad_accum`` is 1. Pure arithmetic; every failure is a :class:`Problem` with a fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import Problem


@dataclass(frozen=True)
class Layout:
    """A recipe's sizes, all resolved."""

    data: int
    tensor: int
    pipeline: int
    global_batch: int
    micro_batch: int
    grad_accum: int

    @property
    def world_size(self) -> int:
        return self.data * self.tensor * self.pipeline

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step on each data-parallel rank (the pipeline's in-flight count)."""
        return self.grad_accum


def resolve_data(recipe, world_size: Optional[int]) -> tuple[Optional[int], list[Problem]]:
    """The data-parallel degree: the recipe's number, or world_size / (tensor x pipeline) for "auto"."""
    par = recipe.parallelism
    model_ranks = par.tensor * par.pipeline
    if par.data != "auto":
        return par.data, []
    if world_size is None:
        return None, []
    if world_size % model_ranks:
        lower = max(model_ranks, world_size - world_size % model_ranks)
        return None, [Problem(
            "$.parallelism.data",
            f'"auto" cannot fill a world of {world_size} processes: tensor x pipeline = {model_ranks} '
            f"does not divide {world_size}",
            f"launch {lower} or {lower + model_ranks} processes, or change tensor/pipeline so their product "
            f"divides {world_size}")]
    return world_size // model_ranks, []


def nearest_multiple(value: int, step: int) -> int:
    """The multiple of ``step`` (>= step) nearest to ``value``; ties go up."""
    down = max(step, value - value % step)
    up = down + step if down < value else down
    return down if value - down < up - value else up


def resolve_batch(batch, data: int) -> tuple[Optional[tuple[int, int, int]], list[Problem]]:
    """(global, micro, grad_accum) from the recipe's batch block and the data degree."""
    g, m, a = batch.global_, batch.micro, batch.grad_accum
    if g is None and m is None:
        return None, [Problem("$.batch", f"grad_accum {a} alone does not say how many samples a step takes",
                              'add "micro" (samples per rank per micro-batch) or "global"')]
    if m is None and a is None:
        a = 1
    if g is None and a is None:
        a = 1
    if g is not None and m is not None and a is not None:
        if g == m * a * data:
            return (g, m, a), []
        good = m * a * data
        return None, [Problem("$.batch.global",
                              f"global {g} != micro {m} x grad_accum {a} x data {data} = {good}",
                              f"set global to {good}, or drop one of the three and let it be derived")]
    if g is None:
        return (m * a * data, m, a), []
    if m is None:
        per = a * data
        if g % per:
            return None, [Problem("$.batch.global",
                                  f"global {g} is not divisible by grad_accum {a} x data {data} = {per}",
                                  f"set global to {nearest_multiple(g, per)} (the nearest multiple of {per})")]
        return (g, g // per, a), []
    per = m * data
    if g % per:
        return None, [Problem("$.batch.global",
                              f"global {g} is not divisible by micro {m} x data {data} = {per}",
                              f"set global to {nearest_multiple(g, per)} (the nearest multiple of {per})")]
    return (g, m, g // per), []


def resolve_layout(recipe, world_size: Optional[int] = None) -> tuple[Optional[Layout], list[Problem]]:
    """The recipe's :class:`Layout` at ``world_size`` (or ``None`` with the problems that prevent it).

    ``world_size`` is the launcher's process count. Without it a numeric ``data`` fixes the world and a
    ``"data": "auto"`` recipe cannot be resolved.
    """
    par = recipe.parallelism
    data, problems = resolve_data(recipe, world_size)
    if data is None:
        if not problems:
            problems = [Problem("$.parallelism.data", '"auto" needs the world size to be resolved',
                                "pass --world-size N (or run under a launcher that sets WORLD_SIZE)")]
        return None, problems
    world = data * par.tensor * par.pipeline
    if world_size is not None and world_size != world:
        model_ranks = par.tensor * par.pipeline
        fits = (f'set "data": {world_size // model_ranks} (or "auto")' if world_size % model_ranks == 0
                else f"no data size fits {world_size} processes with tensor x pipeline = {model_ranks}")
        problems.append(Problem(
            "$.parallelism",
            f"data {data} x tensor {par.tensor} x pipeline {par.pipeline} = {world} processes, "
            f"but the launcher runs {world_size}",
            f"launch {world} processes, or {fits}"))
        return None, problems
    triple, batch_problems = resolve_batch(recipe.batch, data)
    if triple is None:
        return None, problems + batch_problems
    g, m, a = triple
    return Layout(data=data, tensor=par.tensor, pipeline=par.pipeline, global_batch=g, micro_batch=m,
                  grad_accum=a), problems
