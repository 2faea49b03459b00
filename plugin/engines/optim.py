"""The recipe's optimizer as a torch.optim optimizer, the same on every back end.

Weight decay applies to matrices and embeddings (parameters of 2+ dims), not to biases and norm gains, as in
GPT-2/Megatron practice. Which parameters those are is decided once, from each parameter's true shape, on the whole
model before any back end touches it (:meth:`WeightDecay.of`, in :func:`plugin.engines.initialize.initialize`), and
kept by name. A back end builds its optimizer later, from parameters that no longer show that shape: DeepSpeed
ZeRO-3 partitions a parameter into a 1-D placeholder (under meta init before the optimizer exists), FSDP2 makes it
a DTensor, tensor parallelism a new parameter per shard, a pipeline keeps only its stage's. Each is found by its name
in the caller's model (whose modules hold the live parameters, as the checkpoint room relies on), so every back end
(DeepSpeed ZeRO 0-3 and its pipeline, DDP, ZeroRedundancyOptimizer, FSDP2, Accelerate) gets the same groups, and
its updates are the same arithmetic.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn


def true_shape(p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's shape as the model defines it: DeepSpeed ZeRO-3 keeps it in ``ds_shape`` once it has
    partitioned the parameter (a model built under the user's own ``deepspeed.zero.Init``); a DTensor reports its
    global shape itself."""
    return tuple(getattr(p, "ds_shape", p.shape))


@dataclass(frozen=True, eq=False)
class WeightDecay:
    """The one decision: for every name a parameter of ``model`` has (a tied weight has several), whether weight
    decay applies to it."""

    model: nn.Module
    decays: dict[str, bool]

    @classmethod
    def of(cls, model: nn.Module) -> WeightDecay:
        """Decide from ``model`` as the caller gave it: every parameter of 2+ dims decays (matrices, embeddings),
        biases and norm gains do not (GPT-2)."""
        return cls(model, {n: len(true_shape(p)) >= 2 for n, p in model.named_parameters(remove_duplicate=False)})

    def groups(self, params: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict]:
        """``params`` (what one optimizer steps, as its back end holds them now) in a decay and a no-decay group,
        each parameter found by its names in :attr:`model` now (a tie a pipeline split is two parameters now)."""
        names: dict[int, list[str]] = {}
        for n, p in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        params = [p for p in params if p.requires_grad]
        decays = {}
        for p in params:
            known = {self.decays.get(n) for n in names.get(id(p), [None])}
            # internal invariant: a parameter the model does not hold, or one renamed since the decision
            assert len(known) == 1 and None not in known, f"{names.get(id(p))} {tuple(p.shape)}: not decided"
            decays[id(p)] = known.pop()
        groups = [{"params": [p for p in params if decays[id(p)]], "weight_decay": weight_decay},
                  {"params": [p for p in params if not decays[id(p)]], "weight_decay": 0.0}]
        return [g for g in groups if g["params"]]


def optimizer_class_and_kwargs(opt) -> tuple[type, dict]:
    """(torch optimizer class, its keyword arguments besides params/weight_decay) for a recipe optimizer."""
    if opt.name == "adamw":
        return torch.optim.AdamW, {"lr": opt.lr, "betas": tuple(opt.betas), "eps": opt.eps}
    if opt.name == "adam":
        return torch.optim.Adam, {"lr": opt.lr, "betas": tuple(opt.betas), "eps": opt.eps}
    if opt.name == "sgd":
        return torch.optim.SGD, {"lr": opt.lr, "momentum": opt.momentum}
    raise ValueError(f"unknown optimizer {opt.name!r}")  # the schema allows only the three above


def build_optimizer(params: Iterable[torch.nn.Parameter], opt, decay: WeightDecay, *,
                    fused: bool = False) -> torch.optim.Optimizer:
    """The recipe's optimizer ``opt`` over ``params``, grouped by ``decay``. ``fused``: torch's one-kernel Adam /
    AdamW (CUDA parameters); the same update, in fewer launches."""
    cls, kwargs = optimizer_class_and_kwargs(opt)
    if fused and opt.name in ("adam", "adamw"):
        kwargs["fused"] = True
    return cls(decay.groups(params, opt.weight_decay), **kwargs)
