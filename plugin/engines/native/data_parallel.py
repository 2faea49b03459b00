"""The native back end at pipeline 1: the same recipes on PyTorch's own machinery, without DeepSpeed.

How each ZeRO stage maps (over the data-parallel group of :func:`plugin.distributed.groups.build_groups`):

* ZeRO-0: ``DistributedDataParallel`` over the data group; every rank holds whole parameters, gradients
  and optimizer states; gradients are averaged by DDP's all-reduce at the last micro-batch.
* ZeRO-1: DDP for the gradient average, and ``torch.distributed.optim.ZeroRedundancyOptimizer`` over the
  data group: each rank keeps the optimizer states of its partition of the parameters, steps them, and
  broadcasts the updated parameters (DeepSpeed's stage 1: optimizer states partitioned).
* ZeRO-2: whole parameters on every rank, as DeepSpeed's stage 2 keeps them, with the gradients and optimizer
  states of each rank's own rows only (:mod:`.row_shards`): the backward's gradients reduce-scattered into row shards
  at every micro-batch, the optimizer stepping those rows, one all-gather of the updated rows after the step.
  With ``offload_optimizer`` "cpu", and with an expert axis: FSDP2 ``fully_shard(reshard_after_forward=False)``
  (with offload its ``CPUOffloadPolicy``),
  the parameters gathered once per step and kept through its micro-batches (``set_reshard_after_backward`` off
  until the last backward), between steps only each rank's shard (``eval_step`` reshards what it gathered).
* ZeRO-3: FSDP2 ``fully_shard(reshard_after_forward=True)``: parameters are re-gathered for backward.
* CPU offload (``offload_optimizer`` / ``offload_param`` "cpu", stage 2/3): FSDP2's ``CPUOffloadPolicy``
  (sharded parameters, gradients and the optimizer step on the CPU). nvme offload is DeepSpeed's only.

Under FSDP2 each transformer layer (``layers_of(model)`` entries that are registered submodules of the model) is
its own unit, then the root. Tensor parallelism shards the model first with the plugin's layers (plain
tensors, one slice per tensor rank), so FSDP2 shards those slices further over the data group. Pipelines
(``pipeline > 1``) are in :mod:`.pipeline`. Every engine clips by the global norm
(:mod:`plugin.distributed.clipping`) and averages the loss as the DeepSpeed back end does: mean over micro-batches, then
over data ranks, the same float on every rank (with the default token-weighted loss, the mean over the global
batch's target tokens: :class:`plugin.tensor_parallel.hooks.TokenLoss`).

With a context axis (``parallelism.context`` > 1) "the data group" above is data x context, the ranks holding the same
parameters (Megatron's data-parallel group with context parallelism): DDP averages, ZeroRedundancyOptimizer and FSDP2
shard over it, and each context rank's loss is its chunks' share (:attr:`plugin.engines.base.Engine.loss_replicas`);
the model's attention spans the split sequence (:func:`plugin.context_parallel.apply.apply_context_parallel`).

With an expert axis (``parallelism.expert`` > 1) each rank's experts differ within data x context: DDP leaves them
out and they are reduced over the expert-data group after the last micro-batch (:mod:`plugin.expert_parallel.grads`);
ZeRO-1 partitions their optimizer states over that group (:class:`.optimizers.Optimizers`); FSDP2 (ZeRO-2 and 3) makes
them units of their own over it (:func:`.fsdp.shard_experts`).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch

from ...checkpoint.boxes import TensorLayout, tp_segments
from ...context_parallel.apply import apply_context_parallel
from ...expert_parallel import apply_expert_parallel, hf_experts, moe_layers, update_router_biases
from ...materialize.sinks import FSDP2Sink
from ..context import BuildContext
from . import state
from .common import NativeEngine, build_scaler, ids_of, native_optimizer, tensor_sharded_names, wrap_ddp
from .fsdp import reshard_all, shard_fsdp2
from .row_shards import RowShards


class DataParallelEngine(NativeEngine):
    """pipeline = 1: DDP, DDP + ZeroRedundancyOptimizer, row shards (ZeRO-2) or FSDP2, with the plugin's tensor
    parallelism. The data contract's verdict is taken after the backward, before the update."""

    checks_rows_after_backward = True

    def __init__(self, *args, wrapped, loss_fn: Callable, fsdp: bool, gathered_through_step: bool,
                 shards: RowShards | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.wrapped = wrapped
        self.loss_fn = loss_fn
        self.fsdp = fsdp  # FSDP2: DTensor parameters, cast by its MixedPrecisionPolicy, resharded after an eval
        self.data_sharded = fsdp or shards is not None  # gradients are this rank's pieces
        if fsdp:  # the experts' own FSDP2 units reduce them over the expert-data group (fsdp.shard_experts)
            self.expert_params = []
        self.gathered_through_step = gathered_through_step
        self.shards = shards

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
        losses, mean_loss = [], None
        for i, (inputs, labels) in enumerate(micro):
            last = i == len(micro) - 1
            with self._before_micro_batch(last):
                with self.autocast():
                    loss = self.loss_fn(self.call_model(self.wrapped, inputs), labels)
                losses.append(loss.detach().float())
                if last:  # every loss is known: average them while the last backward runs
                    mean_loss = self.start_mean_over_data(torch.stack(losses).mean())
                self.scale(loss / len(micro)).backward()
            if self.shards is not None:
                self.shards.reduce()
        self.reduce_expert_grads()
        self.rows_checked()  # the data contract's verdict: the step has waited for its gradients, nothing updated yet
        self.optimizer_step()
        update_router_biases(self.container)  # DeepSeek's sigmoid routers: their biases follow the step's loads
        if self.shards is not None:
            self.shards.gather()
        return mean_loss()

    def clip_params(self) -> list:
        return self.shards.shards() if self.shards is not None else super().clip_params()

    def discard_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.shards is not None:
            self.shards.drop_grads()

    @torch.no_grad()
    def eval_step(self, batch) -> float:
        """The loss without a backward. Under FSDP2 at ZeRO-2 (``reshard_after_forward=False``) FSDP2 would keep
        the parameters a forward gathered until some backward resharded them, so every unit is resharded here:
        between steps each rank holds its shard only, evaluated or not."""
        self.wrapped.eval()
        losses = []
        for inputs, labels in self.micro_batches(batch):
            with self.autocast():
                losses.append(self.loss_fn(self.call_model(self.wrapped, inputs), labels).detach().float())
        if self.fsdp:
            reshard_all(self.wrapped)
        return self.mean_over_data(torch.stack(losses).mean())


class Zero2Engine(DataParallelEngine):
    """ZeRO-2 on row shards (:mod:`.row_shards`): checkpoints hold each rank's rows of the parameters and of the
    optimizer's states, in the checkpoint room's layout-free format."""

    @functools.cached_property
    def whole_params(self) -> dict:
        return state.named_local_params(self)

    def named_local_params(self) -> dict:
        """``{canonical name: this rank's row view}`` of the trainable parameters (the whole parameter for others)."""
        return {n: self.shards.shard_of(p) if self.shards.shard_of(p) is not None else p
                for n, p in self.whole_params.items()}

    def checkpoint_pieces(self, name, t, global_shape, key):
        param = self.whole_params[name]
        return self.shards.pieces(param, t, tp_segments(tuple(param.shape), global_shape, self.tp_layouts.get(
            name, TensorLayout()), self.groups.tp_rank, self.layout.tensor))

    def after_load(self, manifest) -> None:
        self.shards.gather()  # each rank read its rows: the others' too, everywhere


def build_data_parallel(ctx: BuildContext, groups) -> DataParallelEngine:
    """pipeline = 1: shard the model over the tensor group, then DDP (ZeRO-0/1, with ZeroRedundancyOptimizer at
    ZeRO-1), row shards (ZeRO-2) or FSDP2 (ZeRO-3, and ZeRO-2 with optimizer offload) over the data group."""
    recipe, layout, device = ctx.recipe, ctx.layout, ctx.device
    module = ctx.apply_tp(ctx.model, groups.tensor_group) if layout.tensor > 1 else ctx.model
    apply_context_parallel(module, groups, recipe.context_parallel.method)
    # each rank's experts, cut on meta too (materialising fills them from the whole values)
    if moe_layers(module) or (groups.ep_size > 1 and hf_experts(module)):
        apply_expert_parallel(module, groups, getattr(ctx.apply_tp, "cuts", None),
                              recipe.tensor_parallel.sequence_parallel)
    stage = recipe.zero.stage
    replicas = groups.data_context_size  # ranks holding the same parameters: data x context
    # ZeRO-2 on FSDP2 (parameters gathered once per step) with CPU offload, and with an expert axis: the row shards
    # cut every parameter over one group, where the experts are sharded over another (the expert-data group)
    fsdp = stage == 3 or (stage == 2 and ("cpu" in (recipe.zero.offload_optimizer, recipe.zero.offload_param)
                                          or groups.ep_size > 1))
    if not ctx.on_meta:
        module.to(device)
    elif not fsdp:  # whole parameters on every rank: each unit made and swapped in, one at a time
        ctx.materialize()
        module.to(device)
    sharded_names = tensor_sharded_names(module)
    shards = None
    if fsdp:
        wrapped = shard_fsdp2(module, recipe, groups, device, ctx.layers_of)  # on meta: shards of nothing yet
        if ctx.on_meta:  # FSDP2 allocates this rank's shards; each is cut from its unit's whole value
            z = recipe.zero
            at = torch.device("cpu") if "cpu" in (z.offload_optimizer, z.offload_param) else device
            ctx.materialize(sink=FSDP2Sink(module, at))
    elif stage == 2 and replicas > 1:
        wrapped, shards = module, RowShards(module, groups.data_context_group)
    elif replicas > 1:
        wrapped = wrap_ddp(module, groups, device)
    else:
        wrapped = module
    optimizer = shards.optimizer(module, recipe, ctx.decay) if shards is not None else \
        native_optimizer(module, recipe, groups, zero1=stage == 1 and replicas > 1, decay=ctx.decay)
    tensor_sharded = ids_of(module, sharded_names)
    if shards is not None:
        tensor_sharded = {id(shards.shard_of(p)) for p in module.parameters() if id(p) in tensor_sharded
                          and shards.shard_of(p) is not None}
    engine = (Zero2Engine if shards is not None else DataParallelEngine)(
        recipe, layout, ctx.topology, groups, module, device, container=module, optimizer=optimizer,
        scaler=build_scaler(recipe, device), tensor_sharded=tensor_sharded, wrapped=wrapped,
        loss_fn=ctx.loss_for(groups.tensor_group), fsdp=fsdp, gathered_through_step=fsdp and stage == 2,
        shards=shards)
    return engine
