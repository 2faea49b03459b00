"""The load-balancing losses of a model's MoE layers, added to the training loss.

Each :class:`.layer.MoE` keeps the losses of its last training forward (``aux_loss``, ``z_loss``);
:func:`with_aux_losses` wraps a loss function so that each call adds those kept since the last call, each times its
layer's coefficient (:meth:`.layer.MoE.take_terms`), and clears them. Every
back end calls the loss once per micro-batch right after its forward, so the term is per micro-batch, as the
families compute it; its statistics run over the micro-batch's tokens on every data x context rank (:mod:`.router`).
Pipeline stages before the last compute no loss: there each layer attaches its term to its output
(:class:`StageLosses`), which gives the term its gradient in the backward.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .layer import MoE


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


class AuxLoss:
    """``loss_fn(output, labels)`` plus every layer's weighted terms (:meth:`.layer.MoE.take_terms`); other attributes
    (``prepare``) pass through."""

    def __init__(self, loss_fn: Callable, layers: list[MoE]):
        self.loss_fn, self.layers = loss_fn, layers

    def __getattr__(self, name):
        return getattr(self.__dict__["loss_fn"], name)

    def __call__(self, output, labels):
        loss = self.loss_fn(output, labels)
        terms = [t for t in (m.take_terms() for m in self.layers) if t is not None]
        return loss + sum(terms).to(loss.dtype) if terms else loss


def with_aux_losses(loss_for: Callable, model: nn.Module) -> Callable:
    """``loss_for(tp_group) -> loss_fn`` made to add the model's load-balancing losses (unchanged without MoE)."""
    layers = moe_layers(model)
    if not layers:
        return loss_for

    def wrapped(tp_group):
        return AuxLoss(loss_for(tp_group), layers)

    return wrapped


class _AttachLoss(torch.autograd.Function):
    """forward: ``y`` unchanged; backward: ``dy`` for ``y``, and ``scale()`` for the scalar ``loss`` (its gradient had
    it been added to the training loss), its value kept in ``seen`` (Megatron's ``MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx, y, loss, scale, seen):
        ctx.scale, ctx.seen = scale, seen
        ctx.save_for_backward(loss.detach())
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        (value,) = ctx.saved_tensors
        ctx.seen.append(value)  # a backward ran: a micro-batch's, or the schedule's shape inference (mean_value)
        return dy, torch.ones_like(value) * ctx.scale(), None, None


class StageLosses:
    """The MoE layers of one pipeline rank's stages, whose load-balancing and z terms cannot reach the loss (it is
    computed on the last stage): each layer attaches its weighted term to its output instead (:class:`_AttachLoss`),
    so the backward gives it the gradient it would have had; ``scale()`` is the factor the loss is scaled by for
    backward (fp16's loss scale, else 1). :meth:`mean_value` is the terms' sum per micro-batch, for the reported loss.
    """

    def __init__(self, layers: list[MoE], scale: Callable[[], float]):
        self.layers, self.scale, self.seen = layers, scale, []
        for m in layers:
            m.attach = self.attach

    def attach(self, y: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        return _AttachLoss.apply(y, loss.to(y.dtype), self.scale, self.seen)

    def mean_value(self, micro_batches: int) -> torch.Tensor:
        """The terms of this step's micro-batches, summed, per micro-batch; the record is cleared. Each layer's term
        reaches one backward per micro-batch: the last ``layers x micro_batches`` records. Those before them come
        from the schedule's shape inference on its first step, which runs a backward to the stage's inputs (on empty
        tensors, after the first stage) before the micro-batches."""
        mine = self.seen[len(self.seen) - len(self.layers) * micro_batches:] if self.layers else []
        total = torch.stack(mine).float().sum() if mine else torch.zeros(())
        self.seen.clear()
        return total / micro_batches


def update_router_biases(model: nn.Module) -> None:
    """Every sigmoid router's score-correction bias moved by its step's loads (:meth:`.layer.MoE.update_bias`):
    once per optimizer step, after it, on every rank."""
    for m in moe_layers(model):
        m.update_bias()
