"""Measuring a step for :class:`~.record.StepReport`: the device's peak memory and the largest over the ranks.

One all-reduce (MAX) over the world per step gives the largest peak of any rank (and whether any rank was asked to
stop, :mod:`plugin.job`: a second number in it); the rest of the report is already known everywhere (the loss and
the gradient norm are global, the lr is the schedule's).
``bench/last_step.py`` measures what this costs against a step.
"""
from __future__ import annotations

import resource

import torch
import torch.distributed as dist

from .record import StepReport, device_peak_flops, mfu, model_flops_per_token


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak: CUDA ``max_memory_allocated`` (tensors), else the peak resident set (Linux: KiB)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class StepMeter:
    """Turns one step's numbers into a :class:`StepReport`; built once per engine (the FLOPs and the peak)."""

    def __init__(self, recipe, device: torch.device, world_size: int):
        self.device, self.world_size = device, world_size
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        self.peak_flops = device_peak_flops(name, recipe.precision)
        self.flops_per_token = model_flops_per_token(recipe, world_size)

    def largest(self, stop: bool = False) -> tuple[float, bool]:
        """The largest peak memory of any rank, in GB, and whether any rank's ``stop`` is set (a collective: every
        rank calls it; one all-reduce of two numbers)."""
        value = torch.tensor([float(peak_memory_bytes(self.device)), float(stop)], dtype=torch.float64,
                             device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        memory, stop = value.tolist()
        return memory / 1e9, bool(stop)

    def report(self, *, step: int, loss: float, lr: float | None, grad_norm: float | None, tokens: int,
               seconds: float, stop: bool = False) -> StepReport:
        """``stop``: this rank's request to stop; the report's ``stop_requested`` is any rank's."""
        memory, stop = self.largest(stop)
        return StepReport(step=step, loss=loss, lr=lr, grad_norm=grad_norm, tokens=tokens, step_time_s=seconds,
                          tokens_per_s=tokens / seconds if seconds > 0 else 0.0, memory_gb=memory,
                          mfu=mfu(self.flops_per_token, tokens, seconds, self.world_size, self.peak_flops),
                          stop_requested=stop)
