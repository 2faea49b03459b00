"""What one rank really holds for parameters, gradients and optimizer states, by walking the engine's
objects and counting each tensor storage once (views into DeepSpeed's flat buffers count their buffer).

Parameters: the module's parameters (ZeRO-3: each parameter's own partition, ``ds_tensor``).
Gradients: ``param.grad`` and every tensor the optimizer keeps under a name with "grad" in it.
Optimizer states: everything else the optimizer keeps: torch's per-parameter state (Adam's moments) and
ZeRO's fp32 master partitions. ``other`` is what fits none of these (communication buckets, say).
Used by ``bench/engine.py`` and the estimate cross-check; it imports torch, so it lives with the engines.
"""
from __future__ import annotations

from typing import Iterator

import torch

KINDS = ("parameters", "gradients", "optimizer_states", "other")
_WALK_MODULES = ("deepspeed.runtime", "torch.optim", "torch.distributed.optim")


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
        if t.numel() == 0:
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


def deepspeed_state_bytes(ds_engine) -> dict[str, int]:
    return held_bytes(ds_engine.module, ds_engine.optimizer)
