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
    from .optim import WeightDecay


@dataclass(frozen=True, eq=False)
class BuildContext:
    """The model and everything decided about it before a back end builds its engine.

    ``model``: the whole ``nn.Module``, built with the same seed on every rank (a list of layers already made an
    ``nn.Sequential``). ``layout``: the recipe's sizes at the launched world. ``env``: this process's rank and
    world. ``device``: where this rank computes. ``layers_of(model)``: the model as an ordered layer list, for
    pipeline stages and FSDP2 units. ``apply_tp(model, tp_group, pp_rank=0)``: shards it with the recipe's
    tensor-parallel plan. ``loss_for(tp_group)``: the loss function, once the tensor group exists.
    ``decay``: which parameters weight decay applies to, decided from the whole model
    (:class:`plugin.engines.optim.WeightDecay`): every back end groups its optimizer by it. ``seed``: the init seed
    of meta tensors; ``units``: what :meth:`materialize` fills; ``weights``: where their
    values come from instead (a :class:`plugin.materialize.weights.SafetensorsWeights`), or None for the init.
    ``guard``: this rank's hang guard (:class:`plugin.watchdog.guard.Guard`; None in a world of one): the back end
    calls :meth:`joined` as soon as its default process group exists, and gives every group it makes
    :attr:`pg_timeout`.
    """

    model: Any
    recipe: Recipe
    layout: Layout
    env: LaunchEnv
    device: torch.device
    layers_of: Callable
    apply_tp: Callable
    loss_for: Callable
    decay: WeightDecay
    seed: int = 0
    units: tuple = ()  # the meta model's init units (plugin.materialize.capture); empty for an eager model
    weights: Any = None  # initialize(weights=DIR): the units are filled from these files, each rank its part
    guard: Any = None  # plugin.watchdog.guard.Guard, or None

    @property
    def pg_timeout(self):
        """The ``timedelta`` every process group gets: the recipe's ``watchdog.timeout_s`` (plus NCCL's grace on
        CUDA: :func:`plugin.watchdog.settings.process_group_timeout_s`)."""
        from datetime import timedelta

        from ..watchdog.settings import process_group_timeout_s

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        return timedelta(seconds=process_group_timeout_s(self.recipe.watchdog.timeout_s, backend))

    def joined(self) -> None:
        """The default process group exists: the guard starts its heartbeat and checks that every rank runs this
        recipe at this layout (:meth:`plugin.watchdog.guard.Guard.join`)."""
        if self.guard is not None:
            self.guard.join(self.device)

    @property
    def on_meta(self) -> bool:
        """Whether the model came on the meta device: the back end materialises what this rank holds."""
        return bool(self.units)

    def materialize(self, sink=None, held=None) -> None:
        """Fill this rank's meta tensors of :attr:`model` (``held``: ids of them; None: all) through ``sink``,
        the tensor-parallel cuts re-run on the whole values; then nothing it holds is left on meta. First every
        rank checks that all ranks have the same :attr:`seed` (one all-gather; a :class:`PluginError` on every rank
        when they differ, :func:`plugin.materialize.same_seed.check_same_seed`): the process group must exist."""
        if self.device.type == "meta":  # the dry run: shapes only, nothing to fill
            return
        from ..materialize import materialize
        from ..materialize.same_seed import check_same_seed

        check_same_seed(self.seed, self.device)
        materialize(self.model, list(self.units), self.seed, self.device, sink=sink, held=held,
                    cuts=getattr(self.apply_tp, "cuts", None), source=self.weights)

    @property
    def topology(self) -> Topology:
        """The (pipeline, data, context, tensor) grid of :attr:`layout`."""
        return Topology.from_layout(self.layout)
