"""The native back end: the same recipes on PyTorch's own machinery, without DeepSpeed.

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
(``pipeline > 1``) are in :mod:`.native_pipeline`. Every engine clips by the global norm
(:mod:`plugin.distributed.clipping`) and averages the loss as the DeepSpeed back end does: mean over micro-batches, then
over data ranks, the same float on every rank.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Mapping, Optional

import torch
import torch.distributed as dist

from ...errors import PluginError
from ...optim import build_optimizer, optimizer_class_and_kwargs, param_groups
from ..native_common import NativeEngine, build_scaler, compute_dtype


def init_process_group(device: torch.device) -> None:
    """Join the launcher's rendezvous (env://): NCCL on CUDA, gloo on CPU."""
    if not dist.is_initialized():
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")


def tensor_sharded_names(module: torch.nn.Module) -> set[str]:
    return {n for n, p in module.named_parameters() if getattr(p, "tensor_model_parallel", False)}


def ids_of(module: torch.nn.Module, names: set[str]) -> set[int]:
    """Ids of the parameters called ``names`` now (FSDP2 replaces parameters by DTensor ones)."""
    return {id(p) for n, p in module.named_parameters() if n in names}


def fsdp_units(model: torch.nn.Module, layers_of: Callable) -> list[torch.nn.Module]:
    """The layers FSDP2 shards one by one: entries of ``layers_of(model)`` that are submodules of ``model``
    and share no parameter with another layer (tied weights stay with the root)."""
    try:
        layers = layers_of(model)
    except PluginError:  # the model gives no layer list: the root alone is the unit
        return []
    own = {id(m) for m in model.modules() if m is not model}
    counts: dict[int, int] = {}
    for layer in layers:
        for p in layer.parameters():
            counts[id(p)] = counts.get(id(p), 0) + 1
    return [layer for layer in layers if id(layer) in own and next(layer.parameters(), None) is not None
            and all(counts[id(p)] == 1 for p in layer.parameters())]


def shard_fsdp2(model, recipe, groups, device, layers_of: Callable):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = DeviceMesh.from_group(groups.data_group, device.type, mesh_dim_names=("data",))
    z = recipe.zero
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") \
        if "cpu" in (z.offload_optimizer, z.offload_param) else OffloadPolicy()
    dtype = compute_dtype(recipe)
    inner = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    root = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, output_dtype=torch.float32) \
        if dtype else MixedPrecisionPolicy()
    reshard = z.stage == 3
    for layer in fsdp_units(model, layers_of):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=inner, offload_policy=offload)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=root, offload_policy=offload)


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

    def train_step(self, batch) -> float:
        self.wrapped.train()
        micro = self.micro_batches(batch)
        losses = []
        for i, (inputs, labels) in enumerate(micro):
            with self._before_micro_batch(i == len(micro) - 1):
                with self.autocast():
                    loss = self.loss_fn(self.wrapped(inputs), labels)
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
                losses.append(self.loss_fn(self.wrapped(inputs), labels).detach().float())
        if self.data_sharded:
            reshard_all(self.wrapped)
        return self.mean_over_data(torch.stack(losses).mean())


def reshard_all(module: torch.nn.Module) -> None:
    """Free the gathered parameters of every FSDP2 unit in ``module`` (each keeps its shard)."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def native_optimizer(module, recipe, groups, zero1: bool):
    """The recipe's torch optimizer, or ZeroRedundancyOptimizer over the data group for ZeRO-1."""
    if not zero1:
        return build_optimizer(module.parameters(), recipe.optimizer)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    cls, kwargs = optimizer_class_and_kwargs(recipe.optimizer)
    return ZeroRedundancyOptimizer(param_groups(module.parameters(), recipe.optimizer.weight_decay),
                                   optimizer_class=cls, process_group=groups.data_group,
                                   parameters_as_bucket_view=True, **kwargs)  # one broadcast per rank, not per tensor


def why_not_accelerate(recipe, environ: Mapping[str, str], cuda: bool) -> Optional[str]:
    """Under ``accelerate launch``, the note that says why the native back end trains rather than Accelerate
    itself (:func:`plugin.backends.accelerate_mode`'s reason); None elsewhere, or when the recipe's
    ``launcher`` field chose native."""
    from ...backends import accelerate_mode, launched_by_accelerate
    from ..accelerate_engine import importable

    if not launched_by_accelerate(environ) or recipe.launcher not in ("auto", "accelerate"):
        return None
    mode, why = accelerate_mode(recipe, cuda=cuda, has_deepspeed=importable("deepspeed"),
                                has_transformers=importable("transformers"))
    if mode:
        return None
    return f"{recipe.source or recipe.name}: note: accelerate launch: the native back end trains ({why})"


def build(model, recipe, layout, env, *, device: torch.device, layers_of: Callable, apply_tp: Callable,
          loss_for: Callable) -> NativeEngine:
    """Shard ``model`` per ``recipe`` on torch's own machinery (the signature of every back end's build)."""
    from ...distributed.groups import build_groups
    from ...distributed.topology import Topology

    note = why_not_accelerate(recipe, os.environ, device.type == "cuda") if env.is_main else None
    if note:
        print(note, file=sys.stderr, flush=True)
    if layout.pipeline > 1:
        from ..native_pipeline import check_stage_cuts

        bounds = check_stage_cuts(model, recipe, layout, layers_of)  # before any group: every rank refuses alike
    init_process_group(device)
    topology = Topology(layout.pipeline, layout.data, layout.tensor)
    groups = build_groups(topology)
    loss_fn = loss_for(groups.tensor_group)
    if layout.pipeline > 1:
        from ..native_pipeline import build_pipeline

        return build_pipeline(model, recipe, layout, topology, groups, device=device, layers_of=layers_of,
                              apply_tp=apply_tp, loss_fn=loss_fn, bounds=bounds)
    module = apply_tp(model, groups.tensor_group) if layout.tensor > 1 else model
    module.to(device)
    sharded_names = tensor_sharded_names(module)
    stage = recipe.zero.stage
    if stage >= 2:
        wrapped = shard_fsdp2(module, recipe, groups, device, layers_of)
    elif layout.data > 1:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(module, process_group=groups.data_group,
                                          device_ids=[device] if device.type == "cuda" else None,
                                          gradient_as_bucket_view=True)
    else:
        wrapped = module
    optimizer = native_optimizer(module, recipe, groups, zero1=stage == 1 and layout.data > 1)
    return DataParallelEngine(recipe, layout, topology, groups, module, device, container=module,
                              optimizer=optimizer, scaler=build_scaler(recipe, device),
                              tensor_sharded=ids_of(module, sharded_names), wrapped=wrapped, loss_fn=loss_fn,
                              data_sharded=stage >= 2, gathered_through_step=stage == 2)
