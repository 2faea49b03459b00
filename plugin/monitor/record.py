"""One optimizer step's numbers as a person reads them (``engine.last_step``), and the MFU arithmetic (pure).

MFU (model FLOPs utilisation) is the planner's: model FLOPs per token ``6 x matmul parameters + 12 L s h`` (Narayanan
et al. 2021, :func:`plugin.planning.steptime.model_flops_per_step`, the reference GPT the recipe's ``model`` block
describes) times the step's tokens, over the step time and the peak of every rank's device from the planner's device
table (:data:`plugin.planning.steptime.HARDWARE`: 16-bit tensor-core peak, half of it for fp32 as TF32). Unknown
devices (every CPU) and recipes without a ``model`` block give ``None``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

# the --metrics keys in the order the issue lists them (eval_loss is added on evaluation steps)
METRIC_KEYS = ("step", "loss", "tokens_per_s", "lr", "grad_norm", "tokens", "step_time_s", "memory_gb", "mfu")


@dataclass(frozen=True)
class StepReport:
    """What one ``train_step`` did. ``loss``: the global batch's mean (every rank the same); ``lr``: the learning rate
    its update used; ``grad_norm``: the global 2-norm of the gradients before clipping (every shard once, the norm the
    back end clips with; None where it computes none); ``tokens``: label elements of the global batch;
    ``step_time_s``: this rank's wall time of the step; ``memory_gb``: the largest peak of any rank (CUDA
    ``max_memory_allocated``, the peak RSS on the CPU; GB = 10^9 bytes); ``mfu``: see the module docstring."""

    step: int
    loss: float
    lr: float | None
    grad_norm: float | None
    tokens: int
    step_time_s: float
    tokens_per_s: float
    memory_gb: float | None
    mfu: float | None
    # whether any rank had been asked to stop (a signal; plugin.job) by the end of this step: the same on every rank,
    # carried by the memory's all-reduce; not a metric
    stop_requested: bool = False

    def to_json(self) -> dict:
        d = asdict(self)
        return {k: d[k] for k in METRIC_KEYS}


def device_peak_flops(device_name: str, precision: str) -> float | None:
    """The planner's peak FLOP/s for a device name (``torch.cuda.get_device_name``), halved for fp32 (TF32);
    None when the table does not know the device.

    >>> device_peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    989000000000000.0
    >>> device_peak_flops("NVIDIA A100-SXM4-80GB", "fp32")
    156000000000000.0
    >>> device_peak_flops("cpu", "fp32") is None
    True
    """
    from ..planning.steptime import HARDWARE

    name = device_name.lower()
    for key, hardware in HARDWARE.items():
        if key in name:
            return hardware.peak_flops * (0.5 if precision == "fp32" else 1.0)
    return None


def model_flops_per_token(recipe, world_size: int | None = None) -> float | None:
    """The planner's training FLOPs per token of the recipe's model (None without a ``model`` block)."""
    if recipe.model is None:
        return None
    from ..errors import RecipeError
    from ..planning.for_recipe import setup_from_recipe, spec_from_recipe
    from ..planning.steptime import model_flops_per_step

    try:
        setup = setup_from_recipe(recipe, world_size)
        return model_flops_per_step(spec_from_recipe(recipe), setup) / (setup.global_batch * recipe.model.seq_len)
    except (RecipeError, ValueError):  # a model the planner cannot size: no MFU rather than no step
        return None


def mfu(flops_per_token: float | None, tokens: int, seconds: float, world_size: int,
        peak_flops: float | None) -> float | None:
    """Model FLOPs per second over the peak of ``world_size`` devices; None when either is unknown."""
    if flops_per_token is None or peak_flops is None or seconds <= 0:
        return None
    return flops_per_token * tokens / seconds / (world_size * peak_flops)
