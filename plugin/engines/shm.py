"""DeepSpeed's CPU shared-memory all-reduce buffers, which DeepSpeed 0.19 never unlinks (no torch import:
the launching side of a test or benchmark calls this too)."""
from __future__ import annotations

import os
from pathlib import Path


def release_shm_buffer(rank: int) -> None:
    """Unlink this rank's DeepSpeed CPU all-reduce buffer from /dev/shm.

    On CPU with every rank on one node (``LOCAL_SIZE`` == world size: DeepSpeed's own launcher), DeepSpeed
    0.19's shm comm op creates ``/dev/shm/deepspeed_allreduce_buffer_{uid}_{MASTER_ADDR}_{MASTER_PORT}_{rank}``
    (about 68 MB) per rank and never unlinks it: every run leaks world x 68 MB of RAM-backed /dev/shm, and a
    test suite fills the machine's memory. Call once no collective is left (the peers mapped it at start-up;
    their mappings stay valid until they exit). Missing files (no shm op, other launchers) are fine.
    """
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass


def release_shm_buffers_of_launch(port) -> None:
    """Unlink every rank's buffer of a ``deepspeed`` launch on ``port`` (its ``--master_port``), from the
    launching side once the launch is over: a rank that crashed never reached :func:`release_shm_buffer`, and
    a script that stepped DeepSpeed engines of its own never called it."""
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
        path.unlink(missing_ok=True)
