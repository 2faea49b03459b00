"""The recipe's learning-rate schedule as arithmetic (pure: no torch).

The learning rate used by the update of step ``s`` (1-based: the first ``train_step`` is step 1), for a recipe with
optimizer ``lr`` and ``"lr_schedule": {"warmup_steps": W, "decay": ..., "decay_steps": D, "min_lr": m}``:

* ``s <= W``: ``lr * s / W`` (linear warmup from 0; nothing to warm up at W = 0);
* ``W < s <= D``: from ``lr`` at step W to ``m`` at step D, ``p = (s - W) / (D - W)`` of the way: ``linear``
  ``lr + (m - lr) * p``, ``cosine`` ``m + (lr - m) * (1 + cos(pi * p)) / 2``;
* after that ``m``. ``constant`` keeps ``lr`` after the warmup (``decay_steps`` and ``min_lr`` unused).

The schedule counts ``train_step`` calls (the checkpoint's step), a step whose update fp16 skipped on overflow
included, so the rate is a function of the step alone, the same on every layout and back end. The engines apply it as
a torch ``LambdaLR`` whose factor is :func:`lr_factor` (:mod:`plugin.engines.lr_schedule`).

>>> from plugin.recipe.spec import LRSchedule
>>> s = LRSchedule(warmup_steps=2, decay="linear", decay_steps=4, min_lr=0.1)
>>> [lr_at(s, 1.0, step) for step in range(1, 6)]
[0.5, 1.0, 0.55, 0.1, 0.1]
>>> round(lr_at(LRSchedule(warmup_steps=0, decay="cosine", decay_steps=4), 1.0, 2), 6)
0.5
"""
from __future__ import annotations

import math

DECAYS = ("constant", "linear", "cosine")


def lr_at(schedule, lr: float, step: int) -> float:
    """The learning rate of the update of ``step`` (1-based) under ``schedule`` (None: ``lr`` throughout)."""
    if schedule is None:
        return lr
    w = schedule.warmup_steps
    if step <= w:
        return lr * step / w
    if schedule.decay == "constant":
        return lr
    d, m = schedule.decay_steps, schedule.min_lr
    if step > d:
        return m
    p = (step - w) / (d - w)
    if schedule.decay == "linear":
        return lr + (m - lr) * p
    return m + (lr - m) * (1 + math.cos(math.pi * p)) / 2


def lr_factor(schedule, lr: float, step: int) -> float:
    """``lr_at(...) / lr``: the multiplier a torch ``LambdaLR`` applies to the optimizer's ``lr``."""
    return lr_at(schedule, lr, step) / lr


def describe(schedule, lr: float) -> str:
    """The schedule in words, for ``show`` and the planner: ``warmup 100 steps, cosine to 3e-05 at step 1000``."""
    if schedule is None:
        return f"constant {lr:g}"
    parts = [f"warmup {schedule.warmup_steps} steps from 0 to {lr:g}"] if schedule.warmup_steps else []
    if schedule.decay == "constant":
        parts.append(f"then constant {lr:g}" if parts else f"constant {lr:g}")
    else:
        parts.append(f"{schedule.decay} decay to {schedule.min_lr:g} at step {schedule.decay_steps}, then "
                     f"{schedule.min_lr:g}")
    return ", ".join(parts)
