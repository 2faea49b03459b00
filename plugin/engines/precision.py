"""The recipe's precision as the engines use it: the torch dtype to compute in, and the fp16 loss scaler's arguments.

The names come from the one table, :data:`plugin.interop.precision.PRECISIONS`. The loss scaler is torch's
(``GradScaler`` / ``ShardedGradScaler``, and Accelerate's ``GradScalerKwargs``, which passes the same two
arguments on) for the recipe's fp16 block, DeepSpeed's keys read the torch way:

* dynamic scaling: ``init_scale = 2 ** initial_scale_power``, ``growth_interval = loss_scale_window``;
* ``loss_scale > 0``: a static scale, starting there and never growing.

DeepSpeed's ``hysteresis`` and ``min_loss_scale`` have no torch equivalent: torch's scale halves at each overflow.
"""
from __future__ import annotations

import torch

from ..interop.precision import PRECISIONS

NEVER = 2 ** 31 - 1  # a growth interval no run reaches: a static scale


def compute_dtype(recipe) -> torch.dtype | None:
    """``torch.bfloat16`` / ``torch.float16`` for bf16 / fp16, None for fp32 (nothing to cast, no autocast)."""
    name = PRECISIONS[recipe.precision].torch_dtype
    return getattr(torch, name) if name else None


def loss_scaler_kwargs(recipe) -> dict:
    """``init_scale`` and ``growth_interval`` of torch's loss scaler for the recipe's fp16 block (see above)."""
    cfg = recipe.fp16_resolved
    if cfg.loss_scale > 0:
        return {"init_scale": float(cfg.loss_scale), "growth_interval": NEVER}
    return {"init_scale": float(2 ** cfg.initial_scale_power), "growth_interval": cfg.loss_scale_window}
