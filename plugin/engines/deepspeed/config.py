"""The ds_config the DeepSpeed engine runs: the recipe's export (:func:`plugin.interop.deepspeed_config.to_ds_config`)
plus the few keys the engine adjusts, each listed with its reason in :data:`ENGINE_ADJUSTED_KEYS`. No deepspeed
import: Accelerate's DeepSpeed plugin (:mod:`plugin.engines.accelerate`) is handed the same config.
"""
from __future__ import annotations

from ...interop.deepspeed_config import to_ds_config


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
    capped at the model's size (ZeRO-3's reduce bucket at the rank's share of it, or the largest parameter).
    ZeRO-3 keeps parameters under 1e5 elements whole on every rank (no all-gather
    for them); that is kept only as far as they cost at most 1% of a rank's parameter partition
    (:func:`persistence_threshold`), so a ZeRO-3 recipe shards what it says and the memory estimates hold.
    For models of real size both bounds leave DeepSpeed's defaults unchanged.
    """
    cap = max(1, sum(numels))
    if zero.get("stage") == 3:
        # ZeRO-3's bucket collects whole gradients before their reduce-scatter: capped at this rank's share (or the
        # largest parameter), not the whole model, which would put one whole fp32 model per rank back (measured by
        # bench/init_memory.py: 0.65 GB of a 162M model's 1/4 = 0.16 GB partition). A gradient larger than the
        # bucket is reduced on its own (DeepSpeed's stage3 copies only what fits the contiguous buffer).
        share = max(-(-cap // max(1, dp)), max(numels, default=1))
        wanted = {"reduce_bucket_size": min(5 * 10 ** 8, share), "stage3_prefetch_bucket_size": min(5 * 10 ** 7, cap),
                  "stage3_param_persistence_threshold": persistence_threshold(numels, dp, 10 ** 5)}
    else:
        wanted = {"reduce_bucket_size": min(5 * 10 ** 8, cap), "allgather_bucket_size": min(5 * 10 ** 8, cap)}
    for key, value in wanted.items():
        zero.setdefault(key, value)  # a value from the recipe's raw deepspeed block is already there


# The keys engine_config changes in the exported ds_config (plugin.interop.deepspeed_config.to_ds_config), and why.
# docs/engines.md ("What the engine adds to the export") lists the same; a test compares the config a running engine
# holds with the export key by key and allows these differences only.
ENGINE_ADJUSTED_KEYS = {
    "optimizer": "dropped: the engine passes torch's optimizer, built from the recipe's optimizer with the same "
                 "hyperparameters (kept only where DeepSpeed's CPUAdam steps an offloaded Adam on CUDA)",
    "zero_force_ds_cpu_optimizer": "false where ZeRO-Offload steps torch's optimizer (DeepSpeed refuses it otherwise)",
    "scheduler": "dropped where the recipe has an lr_schedule: the plugin's LambdaLR sets the lr on every back end "
                 "(plugin/engines/lr_schedule.py); the export's block is DeepSpeed's nearest, not the same",
    "steps_per_print": "2**31 - 1 unless the recipe's deepspeed block sets it: no DeepSpeed log line per step",
    "zero_optimization.reduce_bucket_size": "capped at the parameters this rank holds, at ZeRO-3 at its share "
                                            "(or the largest parameter) (DeepSpeed's 5e8 default allocates 2 GB "
                                            "even for a tiny model)",
    "zero_optimization.allgather_bucket_size": "capped likewise (ZeRO-1/2)",
    "zero_optimization.stage3_prefetch_bucket_size": "capped likewise (ZeRO-3)",
    "zero_optimization.stage3_param_persistence_threshold": "lowered until parameters kept whole cost at most 1% of "
                                                            "the rank's shard (ZeRO-3)",
    "train_batch_size": "x context with a pipeline: the PipelineModule's grid counts every rank holding the stage, "
                        "data x context, as a data rank (DeepSpeed reads no sequence_parallel_size beside it)",
}


def engine_config(recipe, world_size: int, *, use_ds_optimizer: bool, numels: tuple = ()) -> dict:
    """The exported ds_config plus what this engine needs (:data:`ENGINE_ADJUSTED_KEYS`): no optimizer block
    when a torch optimizer is passed, buckets sized to the model (:func:`size_buckets`), and quiet step logging
    unless the recipe's deepspeed block asks for them."""
    cfg = to_ds_config(recipe, world_size)
    raw = recipe.deepspeed or {}
    lay = recipe.layout(world_size)
    if cfg["zero_optimization"]["stage"] >= 1 and numels:
        # ZeRO partitions over data x context (DeepSpeed's sequence-data group, a pipeline grid's data group)
        size_buckets(cfg["zero_optimization"], list(numels), lay.data * lay.context)
    if lay.pipeline > 1:
        cfg["train_batch_size"] *= lay.context
    if not use_ds_optimizer:
        cfg.pop("optimizer", None)
        if recipe.zero.offload_optimizer != "none":
            cfg.setdefault("zero_force_ds_cpu_optimizer", False)
    if recipe.lr_schedule is not None:
        cfg.pop("scheduler", None)
    if "steps_per_print" not in raw:
        cfg["steps_per_print"] = 2 ** 31 - 1
    return cfg
