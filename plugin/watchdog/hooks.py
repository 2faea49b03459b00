"""The engine's phase boundaries, marked in the ledger without the back ends knowing: module and optimizer hooks,
and the engine's public calls wrapped on the instance.

* ``train_step`` -> ``step`` (its batch), ``eval_step`` -> ``eval``, ``save`` / ``load`` -> ``checkpoint``; after
  each call, ``user`` (the training loop's own code, until the next call);
* a forward pre-hook on each module the back end runs once per micro-batch
  (:meth:`plugin.engines.base.Engine.micro_batch_modules`: the model, or each local pipeline stage) -> ``forward``
  of micro-batch k, and a hook on that forward's output tensor -> ``backward`` of micro-batch k when its gradient
  arrives (under 1F1B the two interleave, as they run);
* a step pre-hook on the torch optimizer the update reads (``schedule_optimizer()``) -> ``optimizer``.

Each hook replaces one tuple (:meth:`plugin.watchdog.ledger.Ledger.enter`): no collective, no lock, no store call.
:meth:`EngineHooks.detach` removes them all.
"""
from __future__ import annotations

import torch

from .ledger import Ledger

WRAPPED = {"train_step": "step", "eval_step": "eval", "save": "checkpoint", "load": "checkpoint"}


def _first_grad_tensor(output):
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, (tuple, list)):
        return next((t for t in output if isinstance(t, torch.Tensor) and t.requires_grad), None)
    if isinstance(output, dict):  # transformers' ModelOutput too
        return next((t for t in output.values() if isinstance(t, torch.Tensor) and t.requires_grad), None)
    return None


class EngineHooks:
    def __init__(self, engine, ledger: Ledger):
        self.engine, self.ledger = engine, ledger
        self.handles: list = []

    def attach(self) -> None:
        ledger = self.ledger
        for module in self.engine.micro_batch_modules():
            self.handles.append(module.register_forward_pre_hook(self._forward))
            self.handles.append(module.register_forward_hook(self._after_forward))
        optimizer = self.engine.schedule_optimizer()
        if optimizer is not None and hasattr(optimizer, "register_step_pre_hook"):
            self.handles.append(optimizer.register_step_pre_hook(lambda *_: ledger.enter("optimizer")))
        for name, phase in WRAPPED.items():
            setattr(self.engine, name, self._wrap(getattr(self.engine, name), phase, name == "train_step"))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for name in WRAPPED:
            self.engine.__dict__.pop(name, None)

    def _wrap(self, call, phase: str, is_step: bool):
        ledger, engine = self.ledger, self.engine

        def wrapped(*args, **kwargs):
            if is_step:
                ledger.forwards = ledger.backwards = 0
            ledger.enter(phase)
            try:
                return call(*args, **kwargs)
            finally:
                ledger.step = engine.step_count
                ledger.enter("user")

        wrapped.__wrapped__ = call
        wrapped.__doc__ = call.__doc__
        return wrapped

    def _forward(self, module, args):
        if torch.is_grad_enabled():
            self.ledger.forwards += 1
            self.ledger.enter("forward", f"micro-batch {self.ledger.forwards}")

    def _after_forward(self, module, args, output):
        if not torch.is_grad_enabled():
            return
        t = _first_grad_tensor(output)
        if t is not None:
            k, ledger = self.ledger.forwards, self.ledger
            t.register_hook(lambda grad: ledger.enter("backward", f"micro-batch {k}"))
