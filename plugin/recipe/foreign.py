"""Files that are not recipes but are often given as one: an empty file, a DeepSpeed config, an Accelerate YAML.

Each is said in one problem that names what the file is and what to run instead, where the schema would list a
dozen unknown keys (``$.bf16: did you mean "fp16"?``) or JSON would point at line 1, column 1. Pure: no torch.
"""
from __future__ import annotations

import re
from typing import Any

from ..errors import Problem

# top-level keys of a DeepSpeed config that no recipe has
DEEPSPEED_KEYS = frozenset({"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                            "zero_optimization", "bf16", "optimizer_params", "scheduler", "steps_per_print",
                            "wall_clock_breakdown", "zero_allow_untested_optimizer"})
# the first keys ``accelerate config`` writes: a YAML line "key: value" at the start of the text
ACCELERATE_YAML = re.compile(r"^(compute_environment|distributed_type|num_processes|mixed_precision|machine_rank)"
                             r"\s*:", re.M)
A_RECIPE = "a recipe is JSON with parallelism, batch and model blocks (recipes/cpu_dp4.json is one)"


def empty_file(text: str, file: str = "") -> Problem | None:
    if text.strip():
        return None
    return Problem("$", "the file is empty", f"write a recipe there: {A_RECIPE}", file=file)


def accelerate_yaml(text: str, file: str = "") -> Problem | None:
    """The problem for an Accelerate config (YAML, not JSON), else None: called when the text is not JSON."""
    if not ACCELERATE_YAML.search(text):
        return None
    return Problem("$", "this is an Accelerate config (YAML), not a recipe",
                   f"{A_RECIPE}; a DeepSpeed config becomes one with: python -m plugin import DS_CONFIG.json "
                   "(the JSON file its deepspeed_config_file names, if it has one)", file=file)


def deepspeed_config(data: Any, file: str = "") -> Problem | None:
    """The problem for a DeepSpeed config given as a recipe (its keys, no ``parallelism``), else None."""
    if not isinstance(data, dict) or "parallelism" in data:
        return None
    found = sorted(DEEPSPEED_KEYS & data.keys())
    if not found:
        return None
    return Problem("$", f"this is a DeepSpeed config ({', '.join(found)}), not a recipe",
                   f"convert it: python -m plugin import {file or 'DS_CONFIG.json'} -o recipe.json", file=file)
