"""Several torch optimizers stepped as one, for the native ZeRO-1 with an expert axis.

ZeroRedundancyOptimizer partitions its parameters over one group and, after each step, broadcasts every partition
from the rank that owns it to every other rank in that group. The experts are different on the ranks of the expert
group. So a ZeRO-1 over data x context would overwrite each rank's experts with another rank's. The experts' states
are partitioned over the expert-data group instead (the ranks holding the same experts). The rest of the model is
partitioned over data x context. That makes two optimizers, and :class:`Optimizers` makes them look like one
``torch.optim.Optimizer`` to everything that reads the engine's optimizer: the lr schedule (a ``LambdaLR`` needs an
``Optimizer``), the fp16 scaler, the hang guard's step hook and the checkpoints (:func:`.state.local_optimizer`).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch


class _States(Mapping):
    """The parts' ``state`` dicts, read as one: ``{parameter: its state}``; ``clear()`` clears every part's."""

    def __init__(self, parts: list[torch.optim.Optimizer]):
        self.parts = parts

    def __getitem__(self, p):
        for o in self.parts:
            if p in o.state:
                return o.state[p]
        raise KeyError(p)

    def __iter__(self) -> Iterator:
        for o in self.parts:
            yield from o.state

    def __len__(self) -> int:
        return sum(len(o.state) for o in self.parts)

    def clear(self) -> None:
        for o in self.parts:
            o.state.clear()


class Optimizers(torch.optim.Optimizer):
    """``parts`` (over disjoint parameters) stepped and zeroed together. ``param_groups`` are the parts' own group
    dicts, so an lr set here is the parts' lr; ``state`` reads the parts' states. Step hooks registered here run
    once around all the parts' steps."""

    def __init__(self, parts: list[torch.optim.Optimizer]):
        self.parts = list(parts)
        # Optimizer.__init__ keeps the group dicts it is given: the same objects as the parts' groups
        super().__init__([g for o in self.parts for g in o.param_groups], {})
        self.state = _States(self.parts)

    def step(self, closure=None):
        if closure is not None:
            raise TypeError("Optimizers.step takes no closure")
        for o in self.parts:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"parts": [o.state_dict() for o in self.parts]}

    def load_state_dict(self, state_dict) -> None:
        for o, sd in zip(self.parts, state_dict["parts"], strict=True):
            o.load_state_dict(sd)
