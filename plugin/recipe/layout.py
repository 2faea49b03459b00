"""Resolve a recipe's sizes: the data degree (``"auto"``), the world size and the batch triple.

``global = micro x grad_accum x data``: any two given, the third derived; with only ``micro`` or only
``global`` given, ``grad_accum`` is 1. Pure arithmetic; every failure is a :class:`Problem` with a fix.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import Problem


@dataclass(frozen=True)
class Layout:
    """A recipe's sizes, all resolved."""

    data: int
    tensor: int
    pipeline: int
    global_batch: int
    micro_batch: int
    grad_accum: int
    context: int = 1
    expert: int = 1  # carved out of data x context: not a factor of the world size
    expert_tensor: int | None = None  # tensor ranks per expert; None: the tensor degree

    @property
    def world_size(self) -> int:
        return self.data * self.tensor * self.pipeline * self.context

    @property
    def expert_tensor_resolved(self) -> int:
        return self.tensor if self.expert_tensor is None else self.expert_tensor

    @property
    def words(self) -> str:
        """``data D x tensor T x pipeline P``, then `` x context C`` when C > 1 and `` (expert E)`` when E > 1: how
        every door names a layout."""
        words = layout_words(self.data, self.tensor, self.pipeline, self.context)
        if self.expert > 1:
            whole = ", whole experts" if self.expert_tensor_resolved == 1 and self.tensor > 1 else ""
            words += f" (expert {self.expert} of data x context{whole})"
        return words

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step on each data-parallel rank (the pipeline's in-flight count)."""
        return self.grad_accum


def layout_words(data, tensor: int, pipeline: int, context: int = 1) -> str:
    """``data 4 x tensor 2 x pipeline 1`` (`` x context 2`` after it when the context degree is above 1).

    >>> layout_words(2, 2, 1, 2)
    'data 2 x tensor 2 x pipeline 1 x context 2'
    """
    return f"data {data} x tensor {tensor} x pipeline {pipeline}" + (f" x context {context}" if context > 1 else "")


def _model_words(par) -> str:
    """``tensor T x pipeline P`` (`` x context C``): the axes whose product "auto" divides the world by."""
    return f"tensor {par.tensor} x pipeline {par.pipeline}" + (f" x context {par.context}" if par.context > 1 else "")


def processes(n: int) -> str:
    return f"{n} process{'es' if n != 1 else ''}"


def _fitting_worlds(world_size: int, model_ranks: int) -> str:
    """The process counts nearest to ``world_size`` that tensor x pipeline = ``model_ranks`` divides."""
    lower = world_size - world_size % model_ranks
    return " or ".join(str(n) for n in (lower, lower + model_ranks) if n >= model_ranks)


def resolve_data(recipe, world_size: int | None) -> tuple[int | None, list[Problem]]:
    """The data-parallel degree: the recipe's number, or world_size / (tensor x pipeline x context) for "auto"."""
    par = recipe.parallelism
    model_ranks = par.tensor * par.pipeline * par.context
    if par.data != "auto":
        return par.data, []
    if world_size is None:
        return None, []
    if world_size % model_ranks:
        return None, [Problem(
            "$.parallelism.data",
            f'"auto" cannot fill a world of {processes(world_size)}: {_model_words(par)} = {model_ranks} does not '
            f"divide {world_size}",
            f"launch {_fitting_worlds(world_size, model_ranks)} processes, or change "
            f"{'tensor/pipeline/context' if par.context > 1 else 'tensor/pipeline'} so that their product divides "
            f"{world_size}")]
    return world_size // model_ranks, []


def nearest_multiple(value: int, step: int) -> int:
    """The multiple of ``step`` (>= step) nearest to ``value``; ties go up."""
    down = max(step, value - value % step)
    up = down + step if down < value else down
    return down if value - down < up - value else up


def resolve_batch(batch, data: int) -> tuple[tuple[int, int, int] | None, list[Problem]]:
    """(global, micro, grad_accum) from the recipe's batch block and the data degree."""
    g, m, a = batch.global_, batch.micro, batch.grad_accum
    if g is None and m is None:
        return None, [Problem("$.batch", f"grad_accum {a} alone does not say how many samples a step takes",
                              'add "micro" (samples per rank per micro-batch) or "global"')]
    if m is None and a is None:  # only global given: one micro-batch per step, micro derived below
        a = 1
    if g is None and a is None:  # only micro given: one micro-batch per step, global derived below
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


def known_grad_accum(batch, data: int | None = None) -> int | None:
    """The micro-batches per step when the batch block fixes them without a resolved layout (else ``None``):
    given, or 1 when only one of global and micro is, or global / (micro x ``data``) when the recipe's own data
    size is a number and divides evenly (the launched world may still disagree with it)."""
    if batch.grad_accum is not None:
        return batch.grad_accum
    if batch.global_ is not None and batch.micro is not None:
        per = batch.micro * data if isinstance(data, int) else 0
        return batch.global_ // per if per and batch.global_ % per == 0 else None
    return 1


def batch_problems_for_any_data(batch) -> list[Problem]:
    """Batch problems that no data size can fix (for "auto" before the world size is known)."""
    g, m, a = batch.global_, batch.micro, batch.grad_accum
    if g is None and m is None:
        return resolve_batch(batch, 1)[1]
    if g is None:
        return []
    per, what = (m * a, f"micro {m} x grad_accum {a}") if m is not None and a is not None else \
        (m, f"micro {m}") if m is not None else (a or 1, f"grad_accum {a}")
    if g % per == 0:
        return []
    return [Problem("$.batch.global", f"global {g} is not a multiple of {what} = {per}, so global = micro x "
                    "grad_accum x data holds for no data size",
                    f"set global to a multiple of {per} ({nearest_multiple(g, per)} is the nearest)")]


def _mismatch(recipe, data: int | None, world_size: int) -> Problem:
    """The recipe's own world differs from the launcher's: say both ways out, in numbers."""
    par = recipe.parallelism
    model_ranks = par.tensor * par.pipeline * par.context
    world = data * model_ranks
    fix = f"launch {processes(world)}"
    if world_size % model_ranks == 0:
        other = world_size // model_ranks
        fix += f', or set "data": {other} (or "auto") to run on {world_size}'
        triple, problems = resolve_batch(recipe.batch, other)
        if triple is None and problems and problems[0].path == "$.batch.global":
            fix += f" and then {problems[0].hint}"
    else:
        axes = "tensor, pipeline and context" if par.context > 1 else "tensor and pipeline"
        fix += (f"; {world_size} cannot be split into {_model_words(par)} groups "
                f"({model_ranks} does not divide {world_size}): launch {_fitting_worlds(world_size, model_ranks)} "
                f'with "data": "auto", or choose {axes} whose product divides {world_size}')
    return Problem("$.parallelism", f"{layout_words(data, par.tensor, par.pipeline, par.context)} = "
                   f"{processes(world)}, but the launcher runs {world_size}", fix)


def resolve_layout(recipe, world_size: int | None = None) -> tuple[Layout | None, list[Problem]]:
    """The recipe's :class:`Layout` at ``world_size`` (or ``None`` with every problem that prevents it).

    ``world_size`` is the launcher's process count. Without it a numeric ``data`` fixes the world and a
    ``"data": "auto"`` recipe cannot be resolved. The batch triple is checked even when the world does not
    fit: against the recipe's own data size, or (for "auto") for what no data size can fix.
    """
    par = recipe.parallelism
    data, problems = resolve_data(recipe, world_size)
    if data is None:
        if not problems:
            problems = [Problem("$.parallelism.data", '"auto" needs the world size to be resolved',
                                "pass the world size (--world-size N on the command line; under a launcher, "
                                "plugin.initialize takes it from WORLD_SIZE)")]
        return None, problems + batch_problems_for_any_data(recipe.batch)
    world = data * par.tensor * par.pipeline * par.context
    if world_size is not None and world_size != world:
        problems.append(_mismatch(recipe, data, world_size))
    triple, batch_problems = resolve_batch(recipe.batch, data)
    if triple is None or problems:
        return None, problems + batch_problems
    g, m, a = triple
    return Layout(data=data, tensor=par.tensor, pipeline=par.pipeline, global_batch=g, micro_batch=m,
                  grad_accum=a, context=par.context, expert=par.expert, expert_tensor=par.expert_tensor), problems
