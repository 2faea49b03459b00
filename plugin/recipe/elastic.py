"""Which world sizes an elastic recipe trains at, with the same global batch. Pure arithmetic, no torch.

An elastic job (``launch.sh --elastic MIN:MAX``, or ``torchrun --nnodes MIN:MAX``) restarts its workers on every
membership change, each time with another world size. A recipe can follow only if it says what must stay:
``batch.global`` (else the global batch would change with the world) and ``"data": "auto"`` (re-resolved at each
start; grad accumulation adjusts). At a world it cannot use whole (tensor x pipeline does not divide it, or the
global batch does not split into micro x data), the job trains on the largest usable number of processes below
it and the surplus ones sit out:

>>> from plugin.recipe.spec import Recipe
>>> r = Recipe.from_dict({"name": "e", "parallelism": {"data": "auto", "tensor": 2},
...                       "batch": {"global": 16, "micro": 2}})
>>> [(w, usable_world(r, w)) for w in (2, 4, 6, 8, 10, 16, 18)]
[(2, 2), (4, 4), (6, 4), (8, 8), (10, 8), (16, 16), (18, 16)]
>>> elastic_problems(Recipe.from_dict({"name": "f", "parallelism": {"data": 2}, "batch": {"micro": 2}}))[0].path
'$.parallelism.data'
"""
from __future__ import annotations

from ..errors import Problem
from .layout import Layout, resolve_layout


def elastic_problems(recipe) -> list[Problem]:
    """What stops ``recipe`` from following a world that changes size (empty when it can)."""
    problems = []
    if recipe.parallelism.data != "auto":
        problems.append(Problem("$.parallelism.data", f"an elastic job changes its world size, but the recipe fixes "
                                f"data at {recipe.parallelism.data}",
                                'set "data": "auto" (re-resolved at each restart from the processes there are)'))
    if recipe.batch.global_ is None:
        problems.append(Problem("$.batch.global", "an elastic job changes its data size, and without batch.global "
                                "its global batch would change with it (micro x grad_accum x data)",
                                'set "batch": {"global": G, "micro": M}: grad accumulation then adjusts to the data '
                                "size"))
    elif recipe.batch.grad_accum is not None:
        problems.append(Problem("$.batch.grad_accum", "an elastic job keeps batch.global while the data size changes, "
                                "so grad_accum cannot be fixed too",
                                "drop batch.grad_accum (it is derived: global / (micro x data))"))
    return [p.with_file(recipe.source) for p in problems]


def layout_at(recipe, world_size: int) -> Layout | None:
    """The recipe's layout on exactly ``world_size`` processes, or ``None`` when it cannot use them all (an expert
    degree that does not divide the data x context there included: its ranks are carved out of them).

    >>> from plugin.recipe.spec import Recipe
    >>> r = Recipe.from_dict({"name": "e", "parallelism": {"data": "auto", "expert": 4},
    ...                       "batch": {"global": 48, "micro": 1}})
    >>> [w for w in range(1, 13) if layout_at(r, w) is not None]
    [4, 8, 12]
    """
    layout, problems = resolve_layout(recipe, world_size)
    if problems or (layout.data * layout.context) % layout.expert:
        return None
    return layout


def usable_world(recipe, world_size: int) -> int | None:
    """The largest process count <= ``world_size`` at which ``recipe`` trains (``None``: not even one)."""
    for n in range(world_size, 0, -1):
        if layout_at(recipe, n) is not None:
            return n
    return None
