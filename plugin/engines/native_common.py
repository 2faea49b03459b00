"""What the native engines share: precision, the optimizer step (unscale, global-norm clip, step), checkpoints
and the bytes a rank holds.

Precision (the recipe's ``precision`` and ``fp16`` block):

* fp32: nothing.
* bf16 / fp16 with DDP, ZeroRedundancyOptimizer or pipeline stages: ``torch.autocast`` around forward and
  loss, fp32 parameters, gradients and optimizer states (as DeepSpeed's bf16 keeps fp32 master weights).
* bf16 / fp16 with FSDP2 (ZeRO-2/3): ``MixedPrecisionPolicy(param_dtype=bf16|fp16, reduce_dtype=fp32)``,
  fp32 sharded parameters, the root's output cast back to fp32 for the loss.
* fp16: a ``ShardedGradScaler`` (torch's loss scaler that agrees on overflow across every rank, so all
  ranks skip the same steps) with ``init_scale = 2 ** initial_scale_power`` and ``growth_interval =
  loss_scale_window``; a static ``loss_scale > 0`` starts there and never grows. DeepSpeed's
  ``hysteresis`` and ``min_loss_scale`` have no torch equivalent: the scale halves at each overflow.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

from ..distributed.clipping import clip_by_global_norm
from ..tensor_parallel.random import tensor_parallel_rngs  # noqa: F401 (its former home: kept importable)
from .base import Engine

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(recipe) -> Optional[torch.dtype]:
    return _DTYPES.get(recipe.precision)


def build_scaler(recipe, device: torch.device):
    """The fp16 loss scaler from the recipe's fp16 block (None unless precision is fp16)."""
    if recipe.precision != "fp16":
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from ..recipe.spec import LossScale

    cfg = recipe.fp16 or LossScale()
    if cfg.loss_scale > 0:
        kwargs = {"init_scale": float(cfg.loss_scale), "growth_interval": 2 ** 31 - 1}
    else:
        kwargs = {"init_scale": float(2 ** cfg.initial_scale_power), "growth_interval": cfg.loss_scale_window}
    scaler = ShardedGradScaler(device=device.type, process_group=dist.group.WORLD, **kwargs)
    scaler.scale(torch.zeros((), device=device))  # create the scale on every rank, even where no loss is computed
    return scaler


class NativeEngine(Engine):
    """The optimizer step and the checkpoint of every native engine.

    Subclasses set ``container`` (an ``nn.Module`` whose parameters are exactly this rank's), ``optimizer``,
    ``scaler``, ``tensor_sharded`` (ids of tensor-sharded parameters), ``data_sharded`` (FSDP2 DTensors).
    """

    backend = "native"
    virtual_stages = 1
    data_sharded = False

    def __init__(self, recipe, layout, topology, groups, module, device, *, container, optimizer, scaler,
                 tensor_sharded: set):
        super().__init__(recipe, layout, topology, groups, module, device)
        self.container = container
        self.optimizer = optimizer
        self.scaler = scaler
        self.tensor_sharded = tensor_sharded
        self.dtype = compute_dtype(recipe)
        self.last_grad_norm: Optional[float] = None

    def autocast(self):
        """Autocast for engines that keep fp32 parameters (FSDP2 casts through its policy instead)."""
        if self.dtype is None or self.data_sharded:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def optimizer_step(self) -> None:
        """Unscale (fp16), clip by the global norm, step (skipped by the scaler on overflow), zero grads."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = list(self.container.parameters())
        norm = clip_by_global_norm(
            params, float(self.recipe.gradient_clipping), tensor_sharded=self.tensor_sharded,
            tp_rank=self.groups.tp_rank, model_group=self.groups.model_group,
            model_size=self.groups.model_size,
            data_group=self.groups.data_group if self.layout.data > 1 else None,
            data_sharded=self.data_sharded, device=self.device)
        self.last_grad_norm = float(norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory: str, client_state: Optional[dict] = None) -> None:
        from . import native_state

        native_state.save(self, directory, client_state)

    def load(self, directory: str) -> dict:
        from . import native_state

        return native_state.load(self, directory)

    # ------------------------------------------------------------------ memory
    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer states, counted as for DeepSpeed
        (:func:`plugin.engines.memory.held_bytes`): this rank's parameters (FSDP2: its shards), their
        gradients (DDP: views into its buckets), the optimizer's states (ZeRO-1: this rank's partition).
        Measure inside a step (after a backward) for gradients to exist."""
        from .memory import held_bytes

        return held_bytes(self.container, getattr(self.optimizer, "optim", self.optimizer))
