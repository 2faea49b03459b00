"""One simulated rank: the real :func:`plugin.engines.initialize.initialize` on the meta device over the recording
backend (:mod:`.backend`), then one real ``train_step`` of the recipe; what it holds and what it said, as a dict.

The native back end builds every rank (DeepSpeed's engine allocates its flat buffers on a device and cannot be
built on meta): the same groups, tensor plan, pipeline stages, context axis and ZeRO sharding (DDP,
``ZeroRedundancyOptimizer``, row shards, FSDP2) that a recipe trains with under torchrun. The data contract's
per-step all-gather is left out (``check_peer_rows`` off: its verdict reads the peers' values, which meta does not
hold); everything else in the step runs: micro-batches, the pipeline schedule, the gradient reduction, the
clipping norm, the optimizer's update. FSDP2 (ZeRO-3, ZeRO-2 with CPU offload) is built (its mesh on the CPU, each
parameter's shard on meta) but not stepped: its first forward refuses parameters left on meta; such a rank reports
``"stepped": false``, its shards and no collectives.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import torch

from ..distributed.topology import Topology
from ..expert_parallel import is_expert_param
from ..planning.for_recipe import expected_model_states_for_recipe
from .backend import simulated_rank
from .ranks import compress
from .stages import StageMetadata


def build_model(name: str, dims):
    """``--model``: ``gpt`` (the reference GPT), a transformers causal-LM ``model_type``, or a ``config.json`` /
    directory, sized by the recipe's model block (as train.py's ``--model``); built on meta."""
    with torch.device("meta"):
        if name == "gpt":
            from ..models.gpt import GPT, GPTConfig

            return GPT(GPTConfig.from_recipe_model(dims))
        from ..models.hf import build_hf_model

        return build_hf_model(name, dims)


def _unique_params(module) -> list:
    seen, out = set(), []
    for name, p in module.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def model_parameter_count(model) -> int:
    """Elements of the whole model (a weight shared by two modules counted once)."""
    return sum(p.numel() for _, p in _unique_params(model))


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _nbytes(t) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def _optimizer_states(local) -> list:
    """The state tensors of ``local``, the engine's local optimizer (ZeroRedundancyOptimizer's partition's; with an
    expert axis at ZeRO-1, both partitions')."""
    seen, out = set(), []
    for state in local.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


@dataclass
class Cache:
    """What does not depend on the rank, made once per dry run: the batch, the model's count, the estimates."""

    batch: tuple
    model_count: int
    estimates: dict = field(default_factory=dict)
    stages: StageMetadata = field(default_factory=StageMetadata)
    kernels: dict = field(default_factory=dict)  # the meta kernels' outputs by their inputs (backend.MetaValues)

    def estimate(self, recipe, world_size: int, stage: int) -> dict:
        if stage not in self.estimates:
            s = expected_model_states_for_recipe(recipe, world_size, stage)
            self.estimates[stage] = {"parameters": int(s.parameters), "gradients": int(s.gradients),
                                     "optimizer_states": int(s.optimizer_states), "total": int(s.total)}
        return self.estimates[stage]


def make_cache(recipe, model_name: str, world_size: int) -> Cache:
    layout = recipe.layout(world_size)
    inputs = torch.zeros(layout.global_batch, recipe.model.seq_len, dtype=torch.long)
    model = build_model(model_name, recipe.model)
    return Cache(batch=(inputs, torch.ones_like(inputs)), model_count=model_parameter_count(model))


def _group_names(groups, topology: Topology) -> dict:
    """Global ranks -> the group's name: the recipe's axis words first (tensor, context, data, pipeline), then
    data_context and model; the whole world is ``world``."""
    names = {}
    for axis in topology.AXES:
        ranks = getattr(groups, f"{axis}_ranks", None)
        if ranks and len(ranks) > 1:
            names.setdefault(tuple(ranks), axis)
    names.setdefault(tuple(range(topology.world_size)), "world")
    return names


def _collectives(calls, names: dict) -> list[dict]:
    """Calls grouped by (op, group, bytes, peer) in the order first seen, with their count."""
    out: dict = {}
    for c in calls:
        group = names.get(c.ranks) or f"[{compress(c.ranks)}]"
        key = (c.op, group, c.bytes, c.peer)
        if key not in out:
            out[key] = {"op": c.op, "group": group, "bytes": c.bytes, "count": 0}
            if c.peer is not None:
                out[key]["peer"] = c.peer
        out[key]["count"] += 1
    return list(out.values())


def _sequences(calls) -> dict:
    """Per group (its global ranks as a compressed string): the collectives in order, as (op, bytes)."""
    seq: dict = {}
    for c in calls:
        if c.peer is None:
            seq.setdefault(compress(c.ranks), []).append([c.op, c.bytes])
    return seq


def _no_label_check(n: int, suspect: int, convention: str) -> None:
    return None


def _count_at_update(engine) -> dict:
    """Gradients and optimizer states as they stand when the step's update is done (the optimizer's ``zero_grad``
    then drops the gradients): filled in by the step."""
    found = {"gradients": 0, "optimizer_states": 0}
    optimizer = engine.optimizer
    zero_grad = optimizer.zero_grad

    def counting(*args, **kwargs):
        grads = [t for t in engine.clip_params() if t.grad is not None]
        found["gradients"] = sum(_nbytes(t.grad) for t in grads)
        found["optimizer_states"] = sum(_nbytes(t) for t in _optimizer_states(engine.local_optimizer()))
        return zero_grad(*args, **kwargs)

    optimizer.zero_grad = counting
    return found


def simulate_rank(recipe, model_name: str, world_size: int, rank: int, cache: Cache) -> dict:
    """Build and step ``rank`` of ``world_size``; its report (see :mod:`plugin.dryrun.report` for the fields)."""
    from ..engines.initialize import initialize

    topology = Topology.from_recipe(recipe, world_size)
    start = time.perf_counter()
    inner = topology.tp_size * topology.cp_size
    with simulated_rank(rank, world_size, cache.kernels) as log, cache.stages.patched(inner):
        model = build_model(model_name, recipe.model)
        engine = initialize(model, recipe, backend="native", seed=0, meta=True)
        built = list(log.groups)
        setup_calls, log.calls[:] = list(log.calls), []
        engine.check_peer_rows = False  # the data contract's verdict reads values (module docstring)
        engine.check_labels = _no_label_check  # the label count read from meta is 0: a check of values
        peak = _count_at_update(engine)
        stepped = not getattr(engine, "fsdp", False)  # FSDP2 refuses parameters on meta at its first forward
        if stepped:
            engine.train_step(cache.batch)
        calls = list(log.calls)
        groups = engine.groups
        names = _group_names(groups, topology)
        params = _unique_params(engine.container)
        tp_rank, skip = groups.tp_rank, getattr(engine, "norm_skip", frozenset())
        sharded = engine.tensor_sharded
        counted_ids = {id(p) for _, p in params if id(p) not in skip
                       and (tp_rank == 0 or id(p) in sharded or getattr(p, "tensor_model_parallel", False))}
        # an expert rank's experts stand for its expert group's: each of the E ranks holds as many, others
        experts = sum(p.numel() for _, p in params if id(p) in counted_ids and is_expert_param(p))
        counted = sum(p.numel() for _, p in params if id(p) in counted_ids) + experts * (groups.ep_size - 1)
        held = {"parameters": sum(_nbytes(p) for _, p in params), **peak}
        held["total"] = sum(held.values())
        coord = topology.coord(rank)
        report = {
            "rank": rank,
            "stepped": stepped,
            "coordinates": {"pipeline": coord.pp, "data": coord.dp, "context": coord.cp, "tensor": coord.tp,
                            **({"expert": groups.ep_rank} if groups.ep_size > 1 else {})},
            "groups": {axis: compress(getattr(groups, f"{axis}_ranks")) for axis in topology.AXES
                       if getattr(groups, f"{axis}_ranks", None)},
            "groups_built": sorted({compress(g) for g in built}),
            "parameters": sum(_local(p).numel() for _, p in params),
            "parameters_counted": counted,
            "expert_parameters": experts,
            "bytes": held,
            "estimate": cache.estimate(recipe, world_size, coord.pp),
            "collectives": _collectives(calls, names),
            "setup_collectives": _collectives(setup_calls, names),
            "sequences": _sequences(calls),
        }
        est = report["estimate"]["total"]
        report["ratio"] = round(held["total"] / est, 3) if est else None
    del engine, model, params
    gc.collect()
    report["seconds"] = round(time.perf_counter() - start, 3)
    return report
