"""The native back end at pipeline 1: the same recipes on PyTorch's own machinery, without DeepSpeed.

How each ZeRO stage maps (over the data-parallel group of :func:`plugin.distributed.groups.build_groups`):

* ZeRO-0: ``DistributedDataParallel`` over the data group; every rank holds whole parameters, gradients
  and optimizer states; gradients are averaged by DDP's all-reduce at the last micro-batch.
* ZeRO-1: DDP for the gradient average, and ``torch.distributed.optim.ZeroRedundancyOptimizer`` over the
  data group: each rank keeps the optimizer states of its partition of the parameters, steps them, and
  broadcasts the updated parameters (DeepSpeed's stage 1: optimizer states partitioned).
* ZeRO-2: FSDP2 ``fully_shard(reshard_after_forward=False)`` on a 1-D data mesh (``DeviceMesh.from_group``):
  gradients (reduce-scattered at every micro-batch) and optimizer states are sharded; the parameters are
  gathered once per step and stay gathered through all its micro-batches (``set_reshard_after_backward``
  off until the last backward), as DeepSpeed's stage 2 keeps them whole; between steps FSDP2 keeps only
  its shard of them (``eval_step`` reshards what its forward gathered).
* ZeRO-3: FSDP2 ``fully_shard(reshard_after_forward=True)``: parameters are re-gathered for backward.
* CPU offload (``offload_optimizer`` / ``offload_param`` "cpu", stage 2/3): FSDP2's ``CPUOffloadPolicy``
  (sharded parameters, gradients and the optimizer step on the CPU). nvme offload is DeepSpeed's only.

Each transformer layer (``layers_of(model)`` entries that are registered submodules of the model) is its
own FSDP2 unit, then the root. Tensor parallelism shards the model first with the plugin's layers (plain
tensors, one slice per tensor rank), so FSDP2 shards those slices further over the data group. Pipelines
(``pipeline > 1``) are in :mod:`.pipeline`. Every engine clips by the global norm
(:mod:`plugin.distributed.clipping`) and averages the loss as the DeepSpeed back end does: mean over micro-batches, then
over data ranks, the same float on every rank (with the default token-weighted loss, the mean over the global
batch's target tokens: :class:`plugin.tensor_parallel.hooks.TokenLoss`).

With a context axis (``parallelism.context`` > 1) "the data group" above is data x context, the ranks holding the same
parameters (Megatron's data-parallel group with context parallelism): DDP averages, ZeroRedundancyOptimizer and FSDP2
shard over it, and each context rank's loss is its chunks' share (:attr:`plugin.engines.base.Engine.loss_replicas`);
the model's attention spans the split sequence (:func:`plugin.context_parallel.apply.apply_context_parallel`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from ...context_parallel.apply import apply_context_parallel
from ...materialize.sinks import FSDP2Sink
from ..context import BuildContext
from .common import NativeEngine, build_scaler, ids_of, native_optimizer, tensor_sharded_names, wrap_ddp
from .fsdp import reshard_all, shard_fsdp2


class DataParallelEngine(NativeEngine):
    """pipeline = 1: DDP, DDP + ZeroRedundancyOptimizer, or FSDP2, with the plugin's tensor parallelism."""

    def __init__(self, *args, wrapped, loss_fn: Callable, data_sharded: bool, gathered_through_step: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.wrapped = wrapped
        self.loss_fn = loss_fn
        self.data_sharded = data_sharded
        self.gathered_through_step = gathered_through_step

    def _before_micro_batch(self, last: bool):
        """DDP: all-reduce once, at the last micro-batch. FSDP2 at ZeRO-2: keep the gathered parameters from
        one micro-batch to the next (DeepSpeed's stage 2 keeps them whole), reshard after the last backward."""
        if self.gathered_through_step:
            self.wrapped.set_reshard_after_backward(last)
        no_sync = getattr(self.wrapped, "no_sync", None)
        return contextlib.nullcontext() if last or no_sync is None else no_sync()

    def _train_step(self, batch) -> float:
        self.wrapped.train()
        micro = self.micro_batches(batch)
        losses = []
        for i, (inputs, labels) in enumerate(micro):
            with self._before_micro_batch(i == len(micro) - 1):
                with self.autocast():
                    loss = self.loss_fn(self.call_model(self.wrapped, inputs), labels)
                self.rows_checked()  # the data contract's verdict, its collective run behind the first forward
                self.scale(loss / len(micro)).backward()
            losses.append(loss.detach().float())
        self.optimizer_step()
        return self.mean_over_data(torch.stack(losses).mean())

    @torch.no_grad()
    def eval_step(self, batch) -> float:
        """The loss without a backward. At ZeRO-2 (``reshard_after_forward=False``) FSDP2 would keep the
        parameters a forward gathered until some backward resharded them, so every unit is resharded here:
        between steps each rank holds its shard only, evaluated or not."""
        self.wrapped.eval()
        losses = []
        for inputs, labels in self.micro_batches(batch):
            with self.autocast():
                losses.append(self.loss_fn(self.call_model(self.wrapped, inputs), labels).detach().float())
        if self.data_sharded:
            reshard_all(self.wrapped)
        return self.mean_over_data(torch.stack(losses).mean())


def build_data_parallel(ctx: BuildContext, groups) -> DataParallelEngine:
    """pipeline = 1: shard the model over the tensor group, then DDP (ZeRO-0/1, with ZeroRedundancyOptimizer at
    ZeRO-1) or FSDP2 (ZeRO-2/3) over the data group."""
    recipe, layout, device = ctx.recipe, ctx.layout, ctx.device
    module = ctx.apply_tp(ctx.model, groups.tensor_group) if layout.tensor > 1 else ctx.model
    apply_context_parallel(module, groups, recipe.context_parallel.method)
    stage = recipe.zero.stage
    replicas = groups.data_context_size  # ranks holding the same parameters: data x context
    if not ctx.on_meta:
        module.to(device)
    elif stage < 2:  # whole parameters on every rank: each unit made and swapped in, one at a time
        ctx.materialize()
        module.to(device)
    sharded_names = tensor_sharded_names(module)
    if stage >= 2:
        wrapped = shard_fsdp2(module, recipe, groups, device, ctx.layers_of)  # on meta: shards of nothing yet
        if ctx.on_meta:  # FSDP2 allocates this rank's shards; each is cut from its unit's whole value
            z = recipe.zero
            at = torch.device("cpu") if "cpu" in (z.offload_optimizer, z.offload_param) else device
            ctx.materialize(sink=FSDP2Sink(module, at))
    elif replicas > 1:
        wrapped = wrap_ddp(module, groups, device)
    else:
        wrapped = module
    optimizer = native_optimizer(module, recipe, groups, zero1=stage == 1 and replicas > 1, decay=ctx.decay)
    engine = DataParallelEngine(recipe, layout, ctx.topology, groups, module, device, container=module,
                                optimizer=optimizer, scaler=build_scaler(recipe, device),
                                tensor_sharded=ids_of(module, sharded_names), wrapped=wrapped,
                                loss_fn=ctx.loss_for(groups.tensor_group), data_sharded=stage >= 2,
                                gathered_through_step=stage == 2)
    # DDP broadcasts buffers in its forward, FSDP2 gathers parameters there
    engine.forward_is_local = stage < 2 and next(module.buffers(), None) is None
    return engine
