"""The process's place in a launched job, read from the launcher's environment, and the check that must pass
before anything distributed is built (pure: no torch).

Every launcher (``deepspeed``, ``torchrun``, ``accelerate launch``) exports RANK, LOCAL_RANK and WORLD_SIZE;
a plain ``python train.py`` has none and is a world of one. The checks here run on every rank before any
process group exists, so a bad recipe makes all ranks exit at once instead of hanging in a rendezvous.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import Problem, RecipeError
from ..recipe.checks import check_recipe

# How long a rank other than 0 waits, after a refusal every rank reached, before it exits (:func:`let_rank_0_speak`)
RANK_0_SPEAKS_S = 15.0


def let_rank_0_speak(environ: Mapping[str, str] = os.environ, wait_s: float = RANK_0_SPEAKS_S) -> None:
    """Where every rank reached the same refusal and rank 0 alone prints it, the other ranks wait ``wait_s`` before
    they exit. A launcher stops every rank as soon as one has exited: DeepSpeed's runner, under load, killed rank 0
    before its message when rank 1 exited first, and the job ended saying nothing. Under a launcher rank 0's own exit
    ends the wait (the launcher stops the rest); started by hand, each rank exits after it."""
    if environ.get("RANK", "0") != "0" and int(environ.get("WORLD_SIZE", "1") or 1) > 1:
        time.sleep(wait_s)


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    local_rank: int
    world_size: int
    launched: bool  # False for a plain `python train.py`

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise RecipeError([Problem("$", f"environment variable {name}={value!r} is not a whole number",
                                   "check how the job was launched")]) from None


def launch_env() -> LaunchEnv:
    """This process's rank, local rank and world size from the launcher (a world of one without one)."""
    world = _env_int("WORLD_SIZE")
    rank = _env_int("RANK")
    local = _env_int("LOCAL_RANK")
    if world is None:
        return LaunchEnv(rank=0, local_rank=0, world_size=1, launched=False)
    return LaunchEnv(rank=rank or 0, local_rank=local if local is not None else (rank or 0), world_size=world,
                     launched=True)


def scheduler_words(environ=None) -> str:
    """``, Slurm job 12 on n[1-2]`` (``, requeued 1 time`` after a requeue) for the ``start:`` line inside a Slurm job,
    else an empty string: what every rank inherits from srun (launch.sh under Slurm: :mod:`plugin.launch.slurm`)."""
    environ = os.environ if environ is None else environ
    job = environ.get("SLURM_JOB_ID", "").strip()
    if not job:
        return ""
    nodes = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or "?"
    restarts = environ.get("SLURM_RESTART_COUNT", "0").strip()
    again = f", requeued {restarts} time{'s' if restarts != '1' else ''}" if restarts not in ("", "0") else ""
    return f", Slurm job {job} on {nodes}{again}"


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

    Only rank 0 prints (the others give it time to: :func:`let_rank_0_speak`); every rank raises, so all of them
    exit before any collective could hang.
    """
    problems = [p for p in check_recipe(recipe, env.world_size) if p.is_error]
    if problems:
        if env.is_main:
            print("\n".join(p.format() for p in problems), file=sys.stderr, flush=True)
        else:
            let_rank_0_speak()
        raise RecipeError(problems)
