"""Which optimizer steps under the DeepSpeed engine: torch's, or DeepSpeed's compiled CPUAdam.

DeepSpeed builds an optimizer from the ds_config's section by JIT-compiling its own ops inside
``deepspeed.initialize`` (FusedAdam needs nvcc, CPUAdam a C++ compiler and ninja): on a machine without them
the job dies there. So the engine passes torch's optimizer, built from the recipe with the same parameter
groups (:func:`plugin.engines.optim.build_optimizer`), with ``fused=True`` on CUDA, and keeps the config's optimizer
section for DeepSpeed only where the recipe needs DeepSpeed's CPUAdam: optimizer offload (``cpu`` / ``nvme``)
of an Adam on CUDA, where torch's AdamW would step the offloaded states far slower. That op is loaded first,
outside ``initialize``; if it cannot be built, rank 0 says so in one line and ZeRO-Offload steps torch's
optimizer instead (``zero_force_ds_cpu_optimizer`` off). Every rank takes the same choice.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class OptimizerChoice:
    deepspeed_op: bool  # DeepSpeed builds its CPUAdam from the config's optimizer section
    fused: bool = False  # torch's fused kernel (CUDA, optimizer states on the device)
    note: str = ""  # one line for rank 0: DeepSpeed's op could not be built, torch's optimizer steps instead


def cpu_adam_error(builder=None) -> str | None:
    """None if DeepSpeed's CPUAdam op loads (prebuilt, cached, or JIT-built now), else why not, in one line.

    ``builder``: a DeepSpeed op builder; by default the current accelerator's ``CPUAdamBuilder``."""
    try:
        if builder is None:
            from deepspeed.ops.op_builder import CPUAdamBuilder

            builder = CPUAdamBuilder()
        builder.load(verbose=False)
    except Exception as e:  # a compiler, ninja or headers missing: any of them ends the build
        first = (str(e).strip().splitlines() or [""])[0]
        return f"{type(e).__name__}: {first[:120]}"
    return None


def _on_every_rank(ok: bool, device: torch.device) -> bool:
    """``ok`` and-ed over the world (a rank that could not build the op makes every rank fall back)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def choose_optimizer(recipe, device: torch.device, builder=None) -> OptimizerChoice:
    """The optimizer the engine runs for ``recipe`` on ``device`` (see the module docstring); ``builder`` as
    in :func:`cpu_adam_error`. Collective where DeepSpeed's op is tried: every rank calls it."""
    offload = recipe.zero.offload_optimizer != "none"
    adam = recipe.optimizer.name in ("adam", "adamw")
    if not offload or device.type != "cuda" or not adam:
        # fused: torch's one-kernel Adam for states on the GPU; without offload they are there
        return OptimizerChoice(deepspeed_op=False, fused=device.type == "cuda" and adam and not offload)
    error = cpu_adam_error(builder)
    if _on_every_rank(error is None, device):
        return OptimizerChoice(deepspeed_op=True)
    name = {"adamw": "AdamW", "adam": "Adam"}[recipe.optimizer.name]
    why = error or "it failed on another rank"
    return OptimizerChoice(deepspeed_op=False, note=(
        f"note: DeepSpeed's CPUAdam op could not be built ({why}); ZeRO-Offload steps torch.optim.{name} on the "
        "CPU instead, slower -> install a C++ compiler and ninja, or prebuild it: DS_BUILD_CPU_ADAM=1 pip install "
        "deepspeed"))
