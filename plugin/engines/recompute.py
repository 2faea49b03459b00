"""Activation checkpointing as the recipe's ``activation_checkpointing`` block says, for every layout and back end.

* ``"full"``, ``every`` k: the model's layer list (:func:`plugin.engines.initialize.layers_of`: the reference GPT's
  ``[embedding, block x L, head]``, a list of layers) runs in spans of k consecutive layers, each span under
  :func:`plugin.tensor_parallel.recompute.checkpoint` (torch's non-reentrant checkpoint that also replays the
  tensor-parallel dropout streams): only a span's input is kept, and backward recomputes the span.
  :func:`run_layers` is that one loop, for a pipeline stage (:class:`plugin.engines.native.pipeline.StageModule`)
  and, at pipeline 1, for the whole model: :func:`apply_activation_checkpointing` replaces the model's forward
  by the loop over its layers (the contract a layer list already has: composed in order, the layers are the
  model). DeepSpeed's ``PipelineModule`` runs the same spans itself (``activation_checkpoint_interval`` k), with
  the same checkpoint function as its ``activation_checkpoint_func``.
  A transformers causal LM at pipeline 1 checkpoints each decoder layer's ``forward`` (``every`` 1 only: its
  forward passes keyword arguments between layers, which a span could not carry); the module hooks (FSDP2's,
  DeepSpeed's) stay outside the checkpoint, as transformers' own gradient checkpointing keeps them.
* ``"selective"``: only the attention core (score matmul, softmax, dropout, attention x V; Korthikanti et al.) is
  recomputed, through the model's ``configure_selective_recompute(True)`` (the reference GPT: each
  ``Attention`` checkpoints its ``scaled_dot_product_attention`` call, replaying its tensor-parallel stream). A
  model without that method is refused by :func:`plugin.engines.model_checks.check_model`.

Without gradients (evaluation) nothing is checkpointed. Called once by :func:`plugin.engines.initialize.initialize`,
before the back end builds, so every back end (DeepSpeed, native, Accelerate) runs the same recompute.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..tensor_parallel.random import tensor_parallel_rngs
from ..tensor_parallel.recompute import checkpoint


def _run(layers: Sequence[nn.Module], x):
    for layer in layers:
        x = layer(x)
    return x


def run_layers(layers: Sequence[nn.Module], x, every: int, rngs=None):
    """``layers`` composed on ``x``; with ``every`` k > 0 and gradients on, in spans of k layers, each span
    checkpointed (its recompute replaying ``rngs``, the tensor-parallel streams; found in the span when None).
    A span without trainable parameters runs as it is, as DeepSpeed's PipelineModule leaves it."""
    if not every or not torch.is_grad_enabled():
        return _run(layers, x)
    for start in range(0, len(layers), every):
        span = list(layers[start:start + every])
        if any(p.requires_grad for layer in span for p in layer.parameters()):
            found = rngs if rngs is not None else [r for layer in span for r in tensor_parallel_rngs(layer)]
            x = checkpoint(_run, span, x, rngs=found)
        else:
            x = _run(span, x)
    return x


def _checkpointed_forward(module: nn.Module, forward: Callable, *args, **kwargs):
    if not (module.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    return checkpoint(lambda *a: forward(*a, **kwargs), *args, rngs=tensor_parallel_rngs(module))


def _model_forward(model: nn.Module, layers_of: Callable, every: int, x):
    return run_layers(layers_of(model), x, every)


def hf_decoder_layers(model) -> list[nn.Module]:
    """A transformers causal LM's decoder layers (the stage list's middle: :mod:`plugin.models.hf_stages`)."""
    from ..models.hf_stages import stage_layers

    return [wrapper.layer for wrapper in stage_layers(model)[1:-1]]


def apply_activation_checkpointing(model: nn.Module, recipe, layers_of: Callable) -> None:
    """Switch on the recipe's recompute in ``model``, in place (module docstring); a no-op for ``"none"``.

    ``layers_of``: the model as its layer list (what pipeline stages cut). Under pipeline > 1 the stages run
    the full spans themselves (:func:`run_layers`, DeepSpeed's interval); only selective is set here."""
    from ..models.hf_stages import is_hf_model

    ac = recipe.activation_checkpointing
    if ac.mode == "selective":
        model.configure_selective_recompute(True)
        return
    if ac.mode != "full" or recipe.parallelism.pipeline > 1:
        return
    if is_hf_model(model):
        assert ac.every == 1, "check_model refuses spans on a transformers model outside pipelines"
        for layer in hf_decoder_layers(model):
            layer.forward = functools.partial(_checkpointed_forward, layer, layer.forward)
        return
    layers_of(model)  # refuses a model that is not a layer list, before anything runs
    model.forward = functools.partial(_model_forward, model, layers_of, ac.every)
