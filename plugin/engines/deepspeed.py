"""The DeepSpeed back end: ZeRO for the data-parallel replicas, PipelineModule for stages, the plugin's
Megatron-style layers for tensor parallelism, all from one exported ds_config.

* pipeline = 1: ``deepspeed.initialize(model, optimizer, config, mpu=groups)``, the plugin's groups as the
  mpu when tensor > 1 (DeepSpeed then averages gradients over the data group only and counts sharded
  parameters once per tensor rank when it clips).
* pipeline > 1: a ``PipelineModule`` over ``PipeModelDataParallelTopology(num_pp, num_mp=tensor, num_dp)``.
  Its grid is the only grid: the tensor groups are taken from it (``get_slice_parallel_group``), and the
  model is sharded after the module has cut its stage, inside the same layer objects.

Before any process group exists, a weight tied across two stages is refused by name
(:mod:`plugin.pipeline_parallel.checks`): the PipelineModule would train two copies of it apart.

Optimizer: the recipe's torch.optim optimizer (fused on CUDA), except DeepSpeed's CPUAdam for an offloaded Adam
on CUDA where that op builds (:mod:`plugin.engines.deepspeed_optimizer`). The exported ds_config is what the
engine runs, but for the keys :data:`ENGINE_ADJUSTED_KEYS` names (the optimizer section, bucket sizes, logging).

Activation checkpointing (``activation_checkpoint_interval >= 1``): the PipelineModule checkpoints its layer
ranges with :func:`plugin.tensor_parallel.recompute.checkpoint` (torch's non-reentrant checkpoint, replaying the
tensor-parallel dropout streams), the native pipeline's function.

Checkpoints: DeepSpeed's own, plus each rank's random state (:meth:`DeepSpeedEngine.save`).

Precision: under bf16 / fp16 DeepSpeed casts the model itself, so floating inputs are cast to that dtype
as they enter (:attr:`~plugin.engines.base.Engine.input_dtype`); integer token ids and labels are not.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Callable, Optional

import torch

from ..interop.deepspeed_config import to_ds_config
from ..pipeline_parallel.checks import check_stage_cut
from ..optim import build_optimizer, param_groups
from ..tensor_parallel.random import tensor_parallel_rngs
from ..tensor_parallel.recompute import checkpoint_func
from .base import Engine
from .deepspeed_optimizer import choose_optimizer
from .rng_state import restore_rng_state, rng_state
from .shm import release_shm_buffer

_TAG = "latest_step"  # the one checkpoint a directory holds


def _rng_file(directory: str, rank) -> str:
    return os.path.join(directory, _TAG, f"rng_rank{rank}.pt")


def persistence_threshold(numels: list[int], dp: int, ceiling: int, budget: float = 0.01) -> int:
    """The largest ZeRO-3 ``stage3_param_persistence_threshold`` <= ``ceiling`` whose whole-kept parameters
    add at most ``budget`` to a rank's parameter partition.

    Parameters under the threshold stay whole on every rank (no all-gather for them); each costs
    ``numel * (1 - 1/dp)`` extra per rank, measured against the rank's share ``total / dp``.
    """
    total = sum(numels)
    best, kept = 0, 0
    for n in sorted(set(numels)):  # a threshold of n + 1 keeps every parameter of n elements or fewer
        kept += n * numels.count(n)
        if n + 1 > ceiling or kept * (dp - 1) > budget * total:
            break
        best = n + 1
    return best


def size_buckets(zero: dict, numels: list[int], dp: int) -> None:
    """DeepSpeed's ZeRO bucket and persistence defaults, bounded by the model, where the recipe's raw
    deepspeed block does not set them.

    The defaults (5e8-element buckets) allocate a 2 GB fp32 bucket per rank even for a tiny model: a bucket is
    capped at the model's size. ZeRO-3 keeps parameters under 1e5 elements whole on every rank (no all-gather
    for them); that is kept only as far as they cost at most 1% of a rank's parameter partition
    (:func:`persistence_threshold`), so a ZeRO-3 recipe shards what it says and the memory estimates hold.
    For models of real size both bounds leave DeepSpeed's defaults unchanged.
    """
    cap = max(1, sum(numels))
    if zero.get("stage") == 3:
        wanted = {"reduce_bucket_size": min(5 * 10 ** 8, cap), "stage3_prefetch_bucket_size": min(5 * 10 ** 7, cap),
                  "stage3_param_persistence_threshold": persistence_threshold(numels, dp, 10 ** 5)}
    else:
        wanted = {"reduce_bucket_size": min(5 * 10 ** 8, cap), "allgather_bucket_size": min(5 * 10 ** 8, cap)}
    for key, value in wanted.items():
        zero.setdefault(key, value)  # a value from the recipe's raw deepspeed block is already there


# The keys engine_config changes in the exported ds_config (plugin.interop.deepspeed_config.to_ds_config), and why. The README
# ("what the engine adds to the export") lists the same; a test compares the config a running engine
# holds with the export key by key and allows these differences only.
ENGINE_ADJUSTED_KEYS = {
    "optimizer": "dropped: the engine passes torch's optimizer, built from the recipe's optimizer with the same "
                 "hyperparameters (kept only where DeepSpeed's CPUAdam steps an offloaded Adam on CUDA)",
    "zero_force_ds_cpu_optimizer": "false where ZeRO-Offload steps torch's optimizer (DeepSpeed refuses it otherwise)",
    "steps_per_print": "2**31 - 1 unless the recipe's deepspeed block sets it: no DeepSpeed log line per step",
    "zero_optimization.reduce_bucket_size": "capped at the parameters this rank holds (DeepSpeed's 5e8 default "
                                            "allocates 2 GB even for a tiny model)",
    "zero_optimization.allgather_bucket_size": "capped likewise (ZeRO-1/2)",
    "zero_optimization.stage3_prefetch_bucket_size": "capped likewise (ZeRO-3)",
    "zero_optimization.stage3_param_persistence_threshold": "lowered until parameters kept whole cost at most 1% of "
                                                            "the rank's shard (ZeRO-3)",
}


def engine_config(recipe, world_size: int, *, use_ds_optimizer: bool, numels: tuple = ()) -> dict:
    """The exported ds_config plus what this engine needs (:data:`ENGINE_ADJUSTED_KEYS`): no optimizer block
    when a torch optimizer is passed, buckets sized to the model (:func:`size_buckets`), and quiet step logging
    unless the recipe's deepspeed block asks for them."""
    cfg = to_ds_config(recipe, world_size)
    raw = recipe.deepspeed or {}
    if cfg["zero_optimization"]["stage"] >= 1 and numels:
        size_buckets(cfg["zero_optimization"], list(numels), recipe.layout(world_size).data)
    if not use_ds_optimizer:
        cfg.pop("optimizer", None)
        if recipe.zero.offload_optimizer != "none":
            cfg.setdefault("zero_force_ds_cpu_optimizer", False)
    if "steps_per_print" not in raw:
        cfg["steps_per_print"] = 2 ** 31 - 1
    return cfg


def count_each_gradient_once(module, tp_rank: int) -> None:
    """Make DeepSpeed's gradient norm count every parameter of a pipeline exactly once.

    With a PipelineModule, DeepSpeed's "model parallel" group is a whole pipeline (pipeline x tensor ranks)
    and its non-ZeRO clipping counts a parameter only if it is marked model-parallel or the rank is that
    group's rank 0 (first stage, tensor rank 0): the other stages' unsharded parameters would be left out
    of the norm. Marking the unsharded parameters of tensor rank 0 on every stage counts each once; the
    sharded ones (``tensor_model_parallel``) count on every tensor rank, as they should. ZeRO's own norm
    uses the tensor rank and the same marks, so it agrees.
    """
    if tp_rank != 0:
        return
    for p in module.parameters():
        if not getattr(p, "tensor_model_parallel", False):
            p.model_parallel = True


_MODEL_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # what DeepSpeed casts the module to


class DeepSpeedEngine(Engine):
    backend = "deepspeed"

    def __init__(self, recipe, layout, topology, groups, ds_engine, loss_fn: Callable, device, pipelined: bool):
        super().__init__(recipe, layout, topology, groups, ds_engine.module, device)
        self.input_dtype = _MODEL_DTYPES.get(recipe.precision)
        self.ds = ds_engine
        self.loss_fn = loss_fn
        self.pipelined = pipelined

    def train_step(self, batch) -> float:
        self.ds.train()
        if self.pipelined:
            loss = self.ds.train_batch(data_iter=iter(self.micro_batches(batch)))
            self.step_count += 1
            return float(loss.item())
        micro = self.micro_batches(batch)
        losses, mean_loss = [], None
        for i, (inputs, labels) in enumerate(micro):
            loss = self.loss_fn(self.ds(inputs), labels)
            losses.append(loss.detach().float())
            if i == len(micro) - 1:  # every loss is known: average them while the last backward runs
                mean_loss = self.start_mean_over_data(torch.stack(losses).mean())
            self.ds.backward(loss)
            self.ds.step()
        self.step_count += 1
        return mean_loss()

    @torch.no_grad()
    def eval_step(self, batch) -> float:
        self.ds.eval()
        if self.pipelined:
            loss = self.ds.eval_batch(data_iter=iter(self.micro_batches(batch)),
                                      num_micro_batches=self.layout.grad_accum)
            return float(loss.item())
        losses = [self.loss_fn(self.ds(x), y).detach().float() for x, y in self.micro_batches(batch)]
        return self.mean_over_data(torch.stack(losses).mean())

    def save(self, directory: str, client_state: Optional[dict] = None) -> None:
        """DeepSpeed's checkpoint (``DIR/latest_step/``, the step in its client_state) and each rank's random state
        (``DIR/latest_step/rng_rank{R}.pt``: torch's and CUDA's generators, the tensor-parallel dropout streams;
        :mod:`plugin.engines.rng_state`). DeepSpeed writes its client_state from data rank 0 only, so the
        random state, which differs from rank to rank, goes in a file of each rank's own."""
        import torch.distributed as dist

        self.ds.save_checkpoint(directory, tag=_TAG, client_state={"step": self.step_count, **(client_state or {})})
        path = _rng_file(directory, dist.get_rank())
        os.makedirs(os.path.dirname(path), exist_ok=True)  # DeepSpeed writes nothing on some data ranks
        torch.save(rng_state(self.module), path)
        dist.barrier()

    def load(self, directory: str) -> dict:
        import torch.distributed as dist

        rng_file = _rng_file(directory, dist.get_rank())
        # Agreed before DeepSpeed loads anything (it talks to the peers): a rank whose file is missing would
        # otherwise leave the others waiting in DeepSpeed's load.
        missing = torch.tensor([0 if os.path.exists(rng_file) else 1], device=self.device)
        dist.all_reduce(missing, op=dist.ReduceOp.MAX)
        if missing.item():
            raise FileNotFoundError(f"{_rng_file(directory, 'R')} is missing on some rank: no DeepSpeed checkpoint of "
                                    f"this engine under {directory!r}, or one written by fewer ranks -> resume from "
                                    "the directory given to --save, with the same number of processes")
        path, state = self.ds.load_checkpoint(directory, tag=_TAG)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {directory!r} (expected {directory}/{_TAG})")
        restore_rng_state(self.module, torch.load(rng_file, weights_only=False), rng_file)
        self.step_count = int(state.get("step", 0))
        return state

    def close(self) -> None:
        """As every engine's, and unlink DeepSpeed's leaked shared-memory buffer (:func:`release_shm_buffer`)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            release_shm_buffer(dist.get_rank())
        super().close()

    def state_bytes(self) -> dict[str, int]:
        from .memory import deepspeed_state_bytes

        return deepspeed_state_bytes(self.ds)


def build(model, recipe, layout, env, *, device: torch.device, layers_of: Callable, apply_tp: Callable,
          loss_for: Callable) -> DeepSpeedEngine:
    """Wrap ``model`` (an ``nn.Module``) per ``recipe``: ``apply_tp(model, tp_group)`` shards it,
    ``layers_of(model)`` lists its layers for a pipeline, ``loss_for(tp_group)`` gives the loss function."""
    if layout.pipeline > 1:  # before any process group: every rank refuses alike, nothing hangs
        check_stage_cut(layers_of(model), recipe.pipeline_parallel.partition, layout.pipeline,
                        "DeepSpeed's PipelineModule")
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
    # DeepSpeed 0.19 still calls torch's deprecated all_gather_into_tensor: one warning per rank, nothing to act on
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor. is deprecated", category=FutureWarning)
    import deepspeed

    from ..distributed.groups import ParallelGroups, build_groups
    from ..distributed.topology import Topology

    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False)
    topology = Topology(layout.pipeline, layout.data, layout.tensor)
    choice = choose_optimizer(recipe, device)
    if choice.note and env.is_main:
        print(choice.note, file=sys.stderr, flush=True)

    if layout.pipeline > 1:
        from deepspeed.pipe import PipelineModule
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        ds_topology = PipeModelDataParallelTopology(num_pp=layout.pipeline, num_mp=layout.tensor,
                                                    num_dp=layout.data)
        pp = recipe.pipeline_parallel
        module = PipelineModule(layers=layers_of(model), topology=ds_topology, partition_method=pp.partition,
                                activation_checkpoint_interval=pp.activation_checkpoint_interval)
        groups = ParallelGroups.from_deepspeed_grid(module._grid)  # one grid: its slice group is the tensor group
        loss_fn = module.loss_fn = loss_for(groups.tensor_group)
        if layout.tensor > 1:
            apply_tp(model, groups.tensor_group, pp_rank=groups.pp_rank)
        count_each_gradient_once(module, groups.tp_rank)
        module.to(device)
        mpu = None  # DeepSpeed requires mpu=None with a PipelineModule; it uses the module's grid
    else:
        groups = build_groups(topology)
        loss_fn = loss_for(groups.tensor_group)
        module = apply_tp(model, groups.tensor_group) if layout.tensor > 1 else model
        module.to(device)
        mpu = groups if layout.tensor > 1 else None

    # buckets sized to what this rank holds: its stage, its tensor shards
    numels = tuple(p.numel() for p in module.parameters())
    config = engine_config(recipe, env.world_size, use_ds_optimizer=choice.deepspeed_op, numels=numels)
    if choice.deepspeed_op:
        optimizer, params = None, param_groups(module.parameters(), recipe.optimizer.weight_decay)
    else:
        optimizer, params = build_optimizer(module.parameters(), recipe.optimizer, fused=choice.fused), None
    ds_engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, model_parameters=params,
                                              config=config, mpu=mpu)
    if layout.pipeline > 1 and recipe.pipeline_parallel.activation_checkpoint_interval > 0:
        # After initialize, which installs DeepSpeed's own checkpoint function: that one replays torch's and
        # DeepSpeed's generators but not the tensor-parallel dropout streams, so recomputed masks would differ.
        ds_engine.module.activation_checkpoint_func = checkpoint_func(tensor_parallel_rngs(module))
    return DeepSpeedEngine(recipe, layout, topology, groups, ds_engine, loss_fn, device,
                           pipelined=layout.pipeline > 1)
