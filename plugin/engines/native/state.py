"""Checkpoints of the native back end: torch.distributed.checkpoint per model-parallel shard, plus each rank's
own small state.

    DIR/native.json                 rank 0: back end, layout, ZeRO stage, step (checked on load)
    DIR/shard_pp{P}_tp{T}/          a DCP checkpoint of {"model", "optim"} written by the data-parallel group
                                    of pipeline rank P, tensor rank T (FSDP2 DTensor shards are written by
                                    their owners; DDP replicas once, by DCP's de-duplication)
    DIR/zero1_pp{P}_tp{T}.pt        ZeRO-1 only: the ZeroRedundancyOptimizer state consolidated on data rank 0
    DIR/rank{R}.pt                  each rank: torch (and CUDA) RNG, the tensor-parallel dropout streams, the
                                    fp16 loss scaler, the caller's client_state

Tensor-sharded weights are plain tensors holding different slices on each tensor rank, so each (P, T)
shard is its own DCP checkpoint; inside one, DCP handles data-parallel sharding and replication, so FSDP2
checkpoints reshard to another data size. Resuming needs the same tensor and pipeline sizes.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ...errors import PluginError
from ..rng_state import restore_rng_state, rng_state

META = "native.json"


def _shard_dir(directory: Path, groups) -> Path:
    return directory / f"shard_pp{groups.pp_rank}_tp{groups.tp_rank}"


def _zero1_file(directory: Path, groups) -> Path:
    return directory / f"zero1_pp{groups.pp_rank}_tp{groups.tp_rank}.pt"


def _is_zero1(optimizer) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def _rank_state(engine, client_state: dict | None) -> dict:
    return {"step": engine.step_count, **rng_state(engine.container),
            "scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
            "client_state": dict(client_state or {})}


def _meta(engine) -> dict:
    lay = engine.layout
    return {"backend": "native", "data": lay.data, "tensor": lay.tensor, "pipeline": lay.pipeline,
            "virtual_stages": engine.virtual_stages, "zero": engine.recipe.zero.stage, "step": engine.step_count}


def save(engine, directory: str, client_state: dict | None = None) -> None:
    """Every rank calls it (collectives inside)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    groups, data_group = engine.groups, engine.groups.data_group
    options = StateDictOptions(ignore_frozen_params=False)
    if _is_zero1(engine.optimizer):
        engine.optimizer.consolidate_state_dict(to=0)
        if groups.dp_rank == 0:
            torch.save(engine.optimizer.state_dict(), _zero1_file(root, groups))
        state = {"model": get_model_state_dict(engine.container, options=options)}
    else:
        model_sd, optim_sd = get_state_dict(engine.container, engine.optimizer, options=options)
        state = {"model": model_sd, "optim": optim_sd}
    dcp.save(state, checkpoint_id=str(_shard_dir(root, groups)), process_group=data_group)
    torch.save(_rank_state(engine, client_state), root / f"rank{dist.get_rank()}.pt")
    if dist.get_rank() == 0:
        (root / META).write_text(json.dumps(_meta(engine), indent=2) + "\n")
    dist.barrier()


def _check_meta(engine, root: Path) -> None:
    path = root / META
    if not path.exists():
        hint = " (it looks like a DeepSpeed checkpoint)" if (root / "latest_step").exists() else ""
        raise FileNotFoundError(f"no native checkpoint under {str(root)!r}: {META} is missing{hint} -> resume with "
                                "the back end that wrote it, from the directory given to --save")
    saved, now = json.loads(path.read_text()), _meta(engine)
    keys = ("tensor", "pipeline", "virtual_stages")
    if any(saved.get(k) != now[k] for k in keys) or (saved.get("zero") == 1) != (now["zero"] == 1):
        was = ", ".join(f"{k} {saved.get(k)}" for k in keys + ("zero",))
        raise PluginError(f"checkpoint {str(root)!r} was written with {was}; this run has "
                          + ", ".join(f"{k} {now[k]}" for k in keys + ("zero",))
                          + " -> resume with the recipe that wrote it (tensor and pipeline sizes must match)")


def load(engine, directory: str) -> dict:
    """Restore what :func:`save` wrote into ``engine`` (every rank calls it); returns the client_state."""
    root = Path(directory)
    _check_meta(engine, root)
    groups = engine.groups
    mine = root / f"rank{dist.get_rank()}.pt"
    if not mine.exists():
        raise FileNotFoundError(f"{mine} is missing: the checkpoint was written by fewer ranks -> resume with "
                                "the same number of processes")
    rank_state = torch.load(mine, weights_only=False)
    if _is_zero1(engine.optimizer):
        state = {"model": get_model_state_dict(engine.container)}
        dcp.load(state, checkpoint_id=str(_shard_dir(root, groups)), process_group=groups.data_group)
        set_model_state_dict(engine.container, state["model"])
        engine.optimizer.load_state_dict(torch.load(_zero1_file(root, groups), weights_only=False))
    else:
        model_sd, optim_sd = get_state_dict(engine.container, engine.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(_shard_dir(root, groups)), process_group=groups.data_group)
        set_state_dict(engine.container, engine.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    engine.optimizer.zero_grad(set_to_none=True)  # DCP's optimizer-state init leaves zero gradients behind
    restore_rng_state(engine.container, rank_state, str(mine))
    if engine.scaler is not None and rank_state.get("scaler"):
        engine.scaler.load_state_dict(rank_state["scaler"])
    engine.step_count = int(rank_state["step"])
    return {"step": engine.step_count, **rank_state["client_state"]}
