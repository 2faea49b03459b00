"""Activation checkpointing that recomputes the forward's tensor-parallel dropout masks.

``torch.utils.checkpoint`` replays torch's default generators (the CPU's and the inputs' device's) when it
recomputes a checkpointed range in backward. The tensor-parallel dropout streams (:class:`~.random.TensorParallelRNG`:
each tensor rank's own stream for sharded regions) live outside them: a recompute would draw other masks than
the forward did, and the gradients would belong to another forward. :func:`checkpoint` is torch's non-reentrant
checkpoint with a context that starts the recompute where the forward started those streams and afterwards
puts them back where they were, so the next forward draws on as if nothing had been recomputed.

Every recompute of the recipe's ``activation_checkpointing`` goes through it, on both back ends: the span loop
of :func:`plugin.engines.recompute.run_layers` (a native pipeline stage, a whole model at pipeline 1), each
transformers decoder layer outside pipelines, the reference GPT's attention core under ``"selective"``, and, as its
``activation_checkpoint_func`` (:func:`checkpoint_func`), DeepSpeed's ``PipelineModule``, whose own checkpoint
replays only torch's and DeepSpeed's generators.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence

import torch.utils.checkpoint

from .random import TensorParallelRNG


def replay_contexts(rngs: Sequence[TensorParallelRNG]):
    """A ``context_fn`` for torch's checkpoint: (forward context, recompute context). Called as the forward
    starts, it notes where the streams are; the recompute starts them there and, when done, leaves them
    where it found them (other micro-batches' forwards may have drawn from them in between)."""
    at_forward = [rng.state_dict() for rng in rngs]

    @contextlib.contextmanager
    def recompute():
        before = [rng.state_dict() for rng in rngs]
        for rng, state in zip(rngs, at_forward, strict=True):
            rng.load_state_dict(state)
        try:
            yield
        finally:
            for rng, state in zip(rngs, before, strict=True):
                rng.load_state_dict(state)

    return contextlib.nullcontext(), recompute()


def checkpoint(function: Callable, *args, rngs: Sequence[TensorParallelRNG]):
    """``function(*args)`` under torch's non-reentrant checkpoint, its recompute replaying ``rngs`` too.

    Non-reentrant: a range whose inputs need no gradient (integer token ids into an embedding) still gives its
    parameters theirs; DeepSpeed's reentrant default fails there in backward ("element 0 of tensors does not
    require grad")."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             context_fn=functools.partial(replay_contexts, list(rngs)))


def checkpoint_func(rngs: Sequence[TensorParallelRNG]) -> Callable:
    """:func:`checkpoint` bound to ``rngs``, called as DeepSpeed's ``PipelineModule`` calls its
    ``activation_checkpoint_func``: ``func(function, *args)``."""
    return functools.partial(checkpoint, rngs=list(rngs))
