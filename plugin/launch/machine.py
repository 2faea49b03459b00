"""What this machine offers a launch: accelerators, cores, the launchers installed (no torch import)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass


@dataclass
class Machine:
    """What this machine offers: accelerators, cores, installed launchers."""

    gpus: int
    cpus: int
    has_deepspeed: bool
    has_accelerate: bool
    python: str = sys.executable

    @classmethod
    def detect(cls) -> Machine:
        return cls(gpus=count_gpus(), cpus=os.cpu_count() or 1,
                   has_deepspeed=importlib.util.find_spec("deepspeed") is not None,
                   has_accelerate=importlib.util.find_spec("accelerate") is not None)


def count_gpus() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
