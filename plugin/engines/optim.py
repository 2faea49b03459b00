"""The recipe's optimizer as a torch.optim optimizer, the same on every back end.

Weight decay applies to matrices and embeddings (parameters with 2+ dims), not to biases and norm weights,
as in GPT-2/Megatron practice. Every back end (DeepSpeed ZeRO, DDP, ZeroRedundancyOptimizer, FSDP2) gets the
same groups, so their updates are the same arithmetic.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch


def param_groups(params: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]  # matrices, embeddings; not biases, norm gains (GPT-2)
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
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


def build_optimizer(params: Iterable[torch.nn.Parameter], opt, *, fused: bool = False) -> torch.optim.Optimizer:
    """``fused``: torch's one-kernel Adam / AdamW (CUDA parameters); the same update, in fewer launches."""
    cls, kwargs = optimizer_class_and_kwargs(opt)
    if fused and opt.name in ("adam", "adamw"):
        kwargs["fused"] = True
    return cls(param_groups(params, opt.weight_decay), **kwargs)
