"""The load-balancing losses of a model's MoE layers, added to the training loss.

Each :class:`.layer.MoE` keeps the loss of its last training forward (``aux_loss``); :func:`with_aux_losses` wraps a
loss function so that each call adds ``coef x`` the sum of those kept since the last call, then clears them. Every
back end calls the loss once per micro-batch right after its forward, so the term is per micro-batch, as the
families compute it; its statistics run over the micro-batch's tokens on every data x context rank (:mod:`.router`).
"""
from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .layer import MoE


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


class AuxLoss:
    """``loss_fn(output, labels) + coef * sum(layer.aux_loss) + sum(layer.z_loss_coef * layer.z_loss)``; other
    attributes (``prepare``) pass through."""

    def __init__(self, loss_fn: Callable, layers: list[MoE], coef: float):
        self.loss_fn, self.layers, self.coef = loss_fn, layers, coef

    def __getattr__(self, name):
        return getattr(self.__dict__["loss_fn"], name)

    def __call__(self, output, labels):
        loss = self.loss_fn(output, labels)
        kept = [m.aux_loss for m in self.layers if m.aux_loss is not None]
        z = [m.z_loss_coef * m.z_loss for m in self.layers if m.z_loss is not None]
        for m in self.layers:
            m.aux_loss = m.z_loss = None
        if kept and self.coef:
            loss = loss + self.coef * sum(kept).to(loss.dtype)
        if z:
            loss = loss + sum(z).to(loss.dtype)
        return loss


def with_aux_losses(loss_for: Callable, model: nn.Module, coef: float) -> Callable:
    """``loss_for(tp_group) -> loss_fn`` made to add the model's load-balancing losses (unchanged without MoE)."""
    layers = moe_layers(model)
    if not layers:
        return loss_for

    def wrapped(tp_group):
        return AuxLoss(loss_for(tp_group), layers, coef)

    return wrapped


def update_router_biases(model: nn.Module) -> None:
    """Every sigmoid router's score-correction bias moved by its step's loads (:meth:`.layer.MoE.update_bias`):
    once per optimizer step, after it, on every rank."""
    for m in moe_layers(model):
        m.update_bias()
