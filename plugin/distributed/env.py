"""The process's place in a launched job, read from the launcher's environment, and the checks that must
pass before anything distributed is built.

Every launcher (``deepspeed``, ``torchrun``, ``accelerate launch``) exports RANK, LOCAL_RANK and WORLD_SIZE;
a plain ``python train.py`` has none and is a world of one. The checks here run on every rank before any
process group exists, so a bad recipe makes all ranks exit at once instead of hanging in a rendezvous.
"""
from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from typing import Optional

from ..recipe.checks import check_recipe
from ..errors import Problem, RecipeError


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    local_rank: int
    world_size: int
    launched: bool  # False for a plain `python train.py`

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise RecipeError([Problem("$", f"environment variable {name}={value!r} is not a whole number",
                                   "check how the job was launched")])


def launch_env() -> LaunchEnv:
    """This process's rank, local rank and world size from the launcher (a world of one without one)."""
    world = _env_int("WORLD_SIZE")
    rank = _env_int("RANK")
    local = _env_int("LOCAL_RANK")
    if world is None:
        return LaunchEnv(rank=0, local_rank=0, world_size=1, launched=False)
    return LaunchEnv(rank=rank or 0, local_rank=local if local is not None else (rank or 0), world_size=world,
                     launched=True)


def ensure_single_process_env() -> None:
    """A world of one still needs a rendezvous address for torch.distributed / DeepSpeed: give it one."""
    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def check_launch(recipe, env: LaunchEnv) -> None:
    """Raise :class:`RecipeError` (on every rank alike) if the launched world does not fit the recipe.

    Only rank 0 prints; every rank raises, so all of them exit before any collective could hang.
    """
    problems = [p for p in check_recipe(recipe, env.world_size) if p.is_error]
    if problems:
        if env.is_main:
            print("\n".join(p.format() for p in problems), file=sys.stderr, flush=True)
        raise RecipeError(problems)


def model_dims(model) -> dict:
    """Whatever dims the model can tell: heads, kv_heads, hidden, ffn_hidden, vocab, layers."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return {}
    names = {
        "heads": ("heads", "num_attention_heads", "n_head"),
        "kv_heads": ("kv_heads", "num_key_value_heads"),
        "hidden": ("hidden", "hidden_size", "n_embd"),
        "ffn_hidden": ("ffn_hidden", "intermediate_size", "n_inner"),
        "vocab": ("vocab", "vocab_size"),
        "layers": ("layers", "num_hidden_layers", "n_layer"),
    }
    dims = {}
    for key, candidates in names.items():
        for c in candidates:
            value = getattr(cfg, c, None)
            if isinstance(value, int):
                dims[key] = value
                break
    return dims


def check_model(model, recipe) -> list[Problem]:
    """The model's real dims against the recipe: divisibility by tensor and pipeline, and the model block."""
    dims = model_dims(model)
    tp, pp = recipe.parallelism.tensor, recipe.parallelism.pipeline
    where = f"model {type(model).__name__}"
    problems = []
    for key in ("heads", "kv_heads", "hidden", "ffn_hidden"):
        if key in dims and dims[key] % tp:
            problems.append(Problem("$.parallelism.tensor", f"{where} has {key} {dims[key]}, not divisible by "
                                    f"tensor {tp}", f"use a tensor size that divides {dims[key]}"))
    if "layers" in dims and dims["layers"] < pp:
        problems.append(Problem("$.parallelism.pipeline", f"{where} has {dims['layers']} layers, fewer than "
                                f"pipeline {pp} stages", f"use pipeline <= {dims['layers']}"))
    if recipe.model is not None:
        for key, value in dims.items():
            declared = getattr(recipe.model, key, None)
            if key == "kv_heads":
                declared = recipe.model.kv_heads_resolved
            if key == "ffn_hidden":
                declared = recipe.model.ffn_hidden_resolved
            if declared is not None and declared != value:
                problems.append(Problem(f"$.model.{key}", f"the recipe says {key} {declared}, {where} has {value}",
                                        f"set {key} to {value} so the checks and estimates describe this model",
                                        "warning"))
    return [p.with_file(recipe.source) for p in problems]
