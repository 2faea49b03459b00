"""DeepSpeed's CPU shared-memory all-reduce buffers, which DeepSpeed 0.19 never unlinks (no torch import at module
level: the launching side of a test or benchmark calls this too)."""
from __future__ import annotations

import os
from pathlib import Path


def release_shm_buffer(rank: int) -> None:
    """Unlink this rank's DeepSpeed CPU all-reduce buffer from /dev/shm.

    On CPU with every rank on one node (``LOCAL_SIZE`` == world size: DeepSpeed's own launcher), DeepSpeed
    0.19's shm comm op creates ``/dev/shm/deepspeed_allreduce_buffer_{uid}_{MASTER_ADDR}_{MASTER_PORT}_{rank}``
    (about 68 MB) per rank and never unlinks it: every run leaks world x 68 MB of RAM-backed /dev/shm, and a
    test suite fills the machine's memory. Call once every peer has mapped it (:func:`release_mapped_shm_buffer`);
    their mappings stay valid until they exit. Missing files (no shm op, other launchers) are fine.
    """
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass


def release_mapped_shm_buffer() -> None:
    """Every rank, right after ``deepspeed.init_distributed``: unlink this rank's buffer as soon as every peer has
    mapped it, so that no end of the job leaves it behind (a clean close, the hang guard's abort, a SIGKILL).

    DeepSpeed 0.19.8 opens the buffers by name only in ``shm_initialize`` (``csrc/cpu/comm/shm.cpp``: each rank
    creates its own, then maps every peer's, waiting until each exists), which ``init_distributed`` runs; no later
    call opens one again (``shared_close``, the only unlink, is never called). One barrier over the world, and every
    peer is past that point."""
    import torch.distributed as dist

    if dist.get_world_size() > 1:
        dist.barrier()
    release_shm_buffer(dist.get_rank())


def release_shm_buffers_of_launch(port) -> None:
    """Unlink every rank's buffer of a ``deepspeed`` launch on ``port`` (its ``--master_port``), from the
    launching side once the launch is over: a rank that died before :func:`release_mapped_shm_buffer` (inside
    DeepSpeed's start), or a script that started DeepSpeed's comm itself, leaves its buffer behind."""
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
        path.unlink(missing_ok=True)
