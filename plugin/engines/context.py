"""What every back end's ``build`` is given: one frozen :class:`BuildContext`, its only argument.

:func:`plugin.engines.initialize.initialize` makes it once the recipe, the launched world and the model have
passed their checks: the back ends (``deepspeed.engine.build``, ``native.build.build``, ``accelerate.build``) then
differ only in what they do with it, never in what they are told.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..distributed.topology import Topology

if TYPE_CHECKING:  # annotations only: this module imports no torch of its own
    import torch

    from ..distributed.env import LaunchEnv
    from ..recipe.layout import Layout
    from ..recipe.spec import Recipe


@dataclass(frozen=True, eq=False)
class BuildContext:
    """The model and everything decided about it before a back end builds its engine.

    ``model``: the whole ``nn.Module``, built with the same seed on every rank (a list of layers already made an
    ``nn.Sequential``). ``layout``: the recipe's sizes at the launched world. ``env``: this process's rank and
    world. ``device``: where this rank computes. ``layers_of(model)``: the model as an ordered layer list, for
    pipeline stages and FSDP2 units. ``apply_tp(model, tp_group, pp_rank=0)``: shards it with the recipe's
    tensor-parallel plan. ``loss_for(tp_group)``: the loss function, once the tensor group exists.
    """

    model: Any
    recipe: Recipe
    layout: Layout
    env: LaunchEnv
    device: torch.device
    layers_of: Callable
    apply_tp: Callable
    loss_for: Callable

    @property
    def topology(self) -> Topology:
        """The (pipeline, data, tensor) grid of :attr:`layout`."""
        lay = self.layout
        return Topology(pp_size=lay.pipeline, dp_size=lay.data, tp_size=lay.tensor)
