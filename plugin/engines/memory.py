"""What one rank really holds for parameters, gradients and optimizer states, by walking the engine's
objects and counting each tensor storage once (views into DeepSpeed's flat buffers count their buffer).

Parameters: the module's parameters (ZeRO-3: each parameter's own partition, ``ds_tensor``).
Gradients: ``param.grad`` and every tensor the optimizer keeps under a name with "grad" in it.
Optimizer states: everything else the optimizer keeps: torch's per-parameter state (Adam's moments) and
ZeRO's fp32 master partitions. ``other`` is what fits none of these: in DeepSpeed 0.19.8, the gradient
reduction bucket (``ipg_buckets[dtype].buffer``, ``reduce_bucket_size`` elements) that ZeRO-1 allocates at
a micro-batch's first gradient and frees only at the accumulation boundary, and ZeRO-3 keeps; ZeRO-2 frees
it at the end of every backward. Tensors on the ``meta`` device hold no memory and are not counted.
Used by ``bench/engine.py`` and the estimate cross-check; it imports torch, so it lives with the engines.
:func:`deepspeed_zero_partition` is pure: DeepSpeed's own partitioning of a parameter group.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

KINDS = ("parameters", "gradients", "optimizer_states", "other")
# objects whose attributes are walked: DeepSpeed's and torch's optimizers, and the native back end's several-as-one
_WALK_MODULES = ("deepspeed.runtime", "torch.optim", "torch.distributed.optim", "plugin.engines.native.optimizers")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # a DTensor's own shard


def _walk(obj, path: str, depth: int, seen_objs: set) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
        if obj.grad is not None:
            yield path + ".grad", obj.grad
        return
    if depth <= 0 or id(obj) in seen_objs:
        return
    seen_objs.add(id(obj))
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, f"{path}[{k if isinstance(k, (str, int)) else '*'}]", depth - 1, seen_objs)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{path}[{i}]", depth - 1, seen_objs)
    elif type(obj).__module__.startswith(_WALK_MODULES) and hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            if not isinstance(v, torch.nn.Module):
                yield from _walk(v, f"{path}.{k}", depth - 1, seen_objs)


def _kind_of(path: str) -> str:
    lowered = path.lower()
    if "grad" in lowered:
        return "gradients"
    if ".state[" in lowered or "fp32" in lowered or "master" in lowered:
        return "optimizer_states"
    return "other"


_PRIORITY = {"parameters": 0, "optimizer_states": 1, "gradients": 2, "other": 3}


def held_bytes(module: torch.nn.Module, optimizer, *, details: bool = False) -> dict:
    """Bytes this rank holds, by kind (see the module docstring); each storage counted once, under the most
    specific kind it is reachable as (a master partition listed in ``param_groups`` is an optimizer state).
    With ``details``, also the largest "other" storages by path, to see what they are."""
    found: dict = {}  # storage key -> (kind, nbytes, path)

    def add(kind: str, t: torch.Tensor, path: str) -> None:
        t = _local(t)
        if t.numel() == 0 or t.device.type == "meta":  # DeepSpeed keeps shape-only meta copies
            return
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            return
        key = (storage.data_ptr(), str(t.device))
        if key not in found or _PRIORITY[kind] < _PRIORITY[found[key][0]]:
            found[key] = (kind, storage.nbytes(), path)

    for name, p in module.named_parameters():
        add("parameters", p, name)
        ds_tensor = getattr(p, "ds_tensor", None)  # ZeRO-3: this rank's partition
        if ds_tensor is not None:
            add("parameters", ds_tensor, name + ".ds_tensor")
        if p.grad is not None:
            add("gradients", p.grad, name + ".grad")
    for path, t in _walk(optimizer, "optimizer", depth=6, seen_objs=set()):
        add(_kind_of(path), t, path)
    out: dict = dict.fromkeys(KINDS, 0)
    for kind, nbytes, _ in found.values():
        out[kind] += nbytes
    if details:
        out["largest_other"] = sorted(((n, p) for k, n, p in found.values() if k == "other"), reverse=True)[:5]
    return out


def deepspeed_zero_partition(group_numels: list[int], dp: int, rank: int) -> tuple[int, int]:
    """(partition elements, elements of the parameters it touches) of one data-parallel ``rank`` for one
    parameter group, as DeepSpeed 0.19.8's ZeRO-1/2 cuts it (``deepspeed/runtime/zero/stage_1_and_2.py``).

    The group's parameters, in order, are flattened and padded to a multiple of 2 x dp
    (``nccl_start_alignment_factor`` x dp; no per-parameter padding, ``parameter_alignment`` off), and
    cut into dp equal partitions (``get_data_parallel_partitions``). A parameter belongs to a rank's
    partition when it starts inside it or straddles its start (``get_partition_info``). ZeRO-2 keeps the
    *whole* gradient of each such parameter (``copy_grads_in_partition`` into ``grads_in_partition``, kept
    through an accumulation by ``all_grad_tensors``), not just the partition's slice: the second number.
    """
    alignment = 2 * dp
    padded = -(-sum(group_numels) // alignment) * alignment
    size = padded // dp
    start, end = rank * size, (rank + 1) * size
    touched, offset = 0, 0
    for n in group_numels:
        if start <= offset < end or offset < start < offset + n:
            touched += n
        offset += n
    return size, touched


def deepspeed_state_bytes(ds_engine) -> dict[str, int]:
    return held_bytes(ds_engine.module, ds_engine.optimizer)
