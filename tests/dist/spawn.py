"""Run a function on N CPU processes joined by gloo, from inside a test, and get its results back.

    from .spawn import run
    results = run(check_something, 4, "an arg")   # check_something(rank, world_size, "an arg") on 4 ranks

``fn`` must be importable by name (a module-level function of a test module or a helper module). The
children are forked from one forkserver per test session that has imported torch, torch.distributed, the
plugin, transformers and deepspeed (where installed) once: a child starts in milliseconds instead of
re-importing them (several CPU-seconds each, four or eight children on 2 cores, in every test). Each child gets
the calling process's environment as it is at the call (the forkserver's own is the one of its first call), one
OpenMP thread (2 cores are shared by all ranks), ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/
``WORLD_SIZE``/``LOCAL_RANK`` set, ``torch.distributed`` initialized with ``backend`` and a timeout, and
torn down after ``fn`` returns. Returns the list of ``fn``'s return values in rank order (they must
pickle). A child that raises fails the call with that child's traceback; the other children are
stopped, not left hanging in a collective (and the gloo timeout bounds any that would).
"""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# What the forkserver imports once (a missing one is skipped: the no-deepspeed suite has no deepspeed). Not
# torch's compile stack's cost alone: torch.optim's first step imports torch._dynamo (sympy included), every child.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.tensor",
           "torch.distributed.fsdp", "torch.distributed.pipelining", "torch.testing", "plugin", "plugin.engines",
           "plugin.engines.initialize", "plugin.models.gpt", "transformers", "deepspeed", "accelerate")


def free_port() -> int:
    """A TCP port nothing listens on right now (bound once to port 0 and released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, fn: Callable, world_size: int, port: int, backend: str, timeout_s: float,
           args: tuple, out_dir: str, environ: dict) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world_size, *args)
        dist.barrier()  # nobody tears down its group while a peer still talks to it
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))


def run(fn: Callable, world_size: int, *args: Any, backend: str = "gloo", timeout_s: float = 120.0) -> list:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, each rank in its own process."""
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "DS_ACCELERATOR")}
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # read at library load: the children's at start
    # gloo: CPU processes, forked from the preloaded forkserver (deepspeed there has picked its CPU accelerator at
    # import); nccl (the cuda-marked tests): fresh interpreters that find the GPUs themselves
    cpu = backend == "gloo"
    if cpu:
        os.environ["DS_ACCELERATOR"] = "cpu"
        _forkserver_preload()
    try:
        with tempfile.TemporaryDirectory(prefix="dist-") as out_dir:
            mp.start_processes(_child, args=(fn, world_size, free_port(), backend, timeout_s, args, out_dir,
                                             dict(os.environ)),
                               nprocs=world_size, join=True, start_method="forkserver" if cpu else "spawn")
            return [pickle.loads(Path(out_dir, f"{r}.pkl").read_bytes()) for r in range(world_size)]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _forkserver_preload() -> None:
    import multiprocessing.forkserver as fs

    from plugin.engines.choose import importable

    fs.set_forkserver_preload([m for m in PRELOAD if importable(m)])  # read when the forkserver starts
