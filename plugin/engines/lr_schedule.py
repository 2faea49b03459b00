"""The recipe's ``lr_schedule`` as one torch ``LambdaLR`` over the optimizer the back end steps, on every back end.

The factor of step ``s`` is :func:`plugin.recipe.lr_schedule.lr_factor` (the formula lives with the recipe, pure),
so every layout and back end computes the same float for the same step: the native engines schedule their torch
optimizer (or ``ZeroRedundancyOptimizer``, which hands its groups' lr to the local optimizer at each step), DeepSpeed
and Accelerate's DeepSpeed plugin the torch optimizer their ZeRO / bf16 wrappers step (``basic_optimizer``; the
engine config drops the export's ``scheduler`` block), Accelerate's DDP the optimizer inside its wrapper.

The scheduler advances once per ``train_step`` (:meth:`plugin.engines.base.Engine.train_step`), after the update, so
its position is the step count; checkpoints keep it (``scalars.lr_schedule``), and a checkpoint without it resumes at
its step, whichever layout or back end wrote it.
"""
from __future__ import annotations

import warnings

from torch.optim.lr_scheduler import LambdaLR

from ..recipe.lr_schedule import lr_factor


class LRSchedule:
    """A ``LambdaLR`` at the recipe's schedule; :attr:`position` counts the steps taken."""

    def __init__(self, optimizer, recipe):
        schedule, lr = recipe.lr_schedule, recipe.optimizer.lr
        # LambdaLR's index k is the number of steps taken: the next update is step k + 1
        self.scheduler = LambdaLR(optimizer, lambda k: lr_factor(schedule, lr, k + 1))

    @property
    def position(self) -> int:
        return self.scheduler.last_epoch

    def step(self) -> None:
        with warnings.catch_warnings():  # an fp16 step skipped on overflow still advances the schedule (see above)
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.scheduler.step()

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        """Move to ``state["position"]`` and set the optimizer's lr to that step's (``load_state_dict`` of a torch
        scheduler restores its counter, not the optimizer's lr)."""
        self.scheduler.last_epoch = int(state["position"]) - 1
        self.step()


def build_lr_schedule(optimizer, recipe) -> LRSchedule | None:
    """The recipe's schedule over ``optimizer``, or None (no ``lr_schedule``: the optimizer keeps its lr)."""
    if recipe.lr_schedule is None or optimizer is None:
        return None
    return LRSchedule(optimizer, recipe)
