"""FSDP2 for the data-parallel group, ZeRO-2/3 style: which layers are its units, the sharding, and the reshard
that frees what a forward gathered. Accelerate's FSDP2 plugin wraps the same units (:mod:`plugin.engines.accelerate`).

ZeRO-2: ``fully_shard(reshard_after_forward=False)`` on a 1-D data mesh (``DeviceMesh.from_group``): gradients and
optimizer states sharded, parameters gathered once per step. ZeRO-3: ``reshard_after_forward=True``: parameters
re-gathered for backward. With an expert axis the experts are units of their own over the expert-data group
(:func:`shard_experts`). CPU offload (``offload_optimizer`` / ``offload_param`` "cpu"): ``CPUOffloadPolicy``.
Under bf16 / fp16: ``MixedPrecisionPolicy(param_dtype=bf16|fp16, reduce_dtype=fp32)``, fp32 sharded parameters,
the root's output cast back to fp32 for the loss.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ...errors import PluginError
from ..precision import compute_dtype


def fsdp_units(model: torch.nn.Module, layers_of: Callable) -> list[torch.nn.Module]:
    """The blocks FSDP2 shards one by one (the root is the last unit, holding what no block holds), so the
    gathered working set is one block: a transformers model's modules of its ``_no_split_modules`` classes (its
    decoder layers: the unit classes transformers and Accelerate name), else the entries of ``layers_of(model)``
    that are submodules of ``model`` (the reference GPT's blocks; its embedding and head wrappers are not, and
    stay with the root). A block sharing a parameter with another one (tied weights) stays with the root."""
    names = set(no_split_classes(model))
    if names:
        layers = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    else:
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


def no_split_classes(model: torch.nn.Module) -> list[str]:
    """A transformers model's ``_no_split_modules`` (the class names of its blocks), or [] for any other model."""
    names = getattr(model, "_no_split_modules", None)
    return sorted({str(n) for n in names}) if isinstance(names, (list, tuple, set)) else []


def shard_fsdp2(model, recipe, groups, device, layers_of: Callable):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # x context; a dry run on meta puts its mesh on the CPU (FSDP2 has no meta device handle)
    mesh = DeviceMesh.from_group(groups.data_context_group, "cpu" if device.type == "meta" else device.type,
                                 mesh_dim_names=("data",))
    z = recipe.zero
    # Pinned host memory only speeds up copies to and from a CUDA device; on CPU it would be locked for nothing.
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") \
        if "cpu" in (z.offload_optimizer, z.offload_param) else OffloadPolicy()
    dtype = compute_dtype(recipe)
    # Gradients are reduced in fp32 whatever the compute dtype, as DeepSpeed's bf16/fp16 reduce into fp32 masters:
    # a 16-bit sum over many data ranks would round away what one process keeps.
    inner = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    # The root alone casts its output back to fp32, so the loss is computed in fp32 as on the other back ends.
    root = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, output_dtype=torch.float32) \
        if dtype else MixedPrecisionPolicy()
    reshard = z.stage == 3  # ZeRO-3 frees gathered parameters after forward (re-gathers for backward); ZeRO-2 keeps
    if groups.ep_size > 1:  # first, so that the blocks' units leave the experts to their own
        shard_experts(model, groups, device, reshard_after_forward=reshard, mp_policy=inner,
                      offload_policy=offload)
    for layer in fsdp_units(model, layers_of):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=inner, offload_policy=offload)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=root, offload_policy=offload)


def shard_experts(model, groups, device, **fully_shard_args) -> None:
    """With an expert axis, each MoE layer's experts (:func:`plugin.expert_parallel.expert_modules`) are an FSDP2 unit
    of their own over the expert-data group (the ranks holding the same experts: torchtitan's ``dp_mod_ep`` mesh),
    sharded there and reduced there. Their reduce-scatter sums over that group and divides by data x context, not by
    its size: what :func:`plugin.expert_parallel.grads.reduce_expert_grads` does without FSDP2. The parameters'
    marks (expert, tensor-sharded) pass to FSDP2's parameters."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from ...expert_parallel import expert_modules

    mesh = DeviceMesh.from_group(groups.expert_data_group, "cpu" if device.type == "meta" else device.type,
                                 mesh_dim_names=("expert_data",))
    marks = ("expert_parallel", "allreduce", "group_name", "tensor_model_parallel")
    for experts in expert_modules(model):
        kept = {n: {k: getattr(p, k) for k in marks if hasattr(p, k)} for n, p in experts.named_parameters()}
        fully_shard(experts, mesh=mesh, **fully_shard_args)
        experts.set_gradient_divide_factor(float(groups.data_context_size))
        # a sum, then the division: a divide factor other than the group's size is NCCL's PREMUL_SUM otherwise,
        # which gloo refuses ("Cannot use ReduceOp.PREMUL_SUM with Gloo"). Not over one rank: torch 2.13 then
        # divides once in place of the reduce-scatter and again after it (a gradient 1 / factor^2)
        experts.set_force_sum_reduction_for_comms(groups.edp_size > 1)
        for n, p in experts.named_parameters():
            for k, v in kept[n].items():
                setattr(p, k, v)


def reshard_all(module: torch.nn.Module) -> None:
    """Free the gathered parameters of every FSDP2 unit in ``module`` (each keeps its shard)."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
