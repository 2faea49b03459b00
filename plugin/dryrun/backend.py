"""Where the dry run meets torch's process groups: a recording backend, and one simulated rank's world.

* :class:`RecordingGroup`: a Python ``ProcessGroup`` registered as torch's backend ``"dryrun"`` (the way
  ``torch.testing._internal.distributed.fake_pg`` registers its fake one). Every collective and point-to-point
  call of every group reaches it, from Python (``dist.all_reduce``, the pipeline's ``batch_isend_irecv``) or from
  C++ (DDP's reducer, ``ZeroRedundancyOptimizer``): it records the op, the group's global ranks, the bytes and the
  peer, and completes at once with the tensors as they are. torch's own ``FakeProcessGroup`` completes with a future
  of None, which DDP's reducer refuses; this one hands the tensors back, as a real backend does.
* :func:`simulated_rank`: the environment of one rank of the job (``RANK``, ``WORLD_SIZE``), the default group
  on the recording backend, values read from meta tensors answered (:mod:`.meta`), and DDP's start-up check of
  parameter shapes across ranks turned off (an all-gather whose answer it reads, which meta cannot give: the dry run
  compares the ranks itself, :mod:`.checks`); a refusal is not waited for on ranks other than 0 (one process says
  it, once).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from .meta import MetaValues

BACKEND = "dryrun"


@dataclass(frozen=True)
class Call:
    """One call on a group: ``op`` (all_reduce, broadcast, all_gather, reduce_scatter, all_to_all, barrier, send,
    recv), the group's global ranks, the bytes (the buffer for all_reduce, broadcast, send and recv; this rank's
    input for all_gather and all_to_all; its output for reduce_scatter) and the peer's global rank (send, recv)."""

    op: str
    ranks: tuple[int, ...]
    bytes: int
    peer: int | None = None


class Log:
    """What the recording groups of this process saw: every group created (its ranks) and every call."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, ...]] = []
        self.calls: list[Call] = []


LOG = Log()


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _done(value):
    future = torch.futures.Future()
    future.set_result(value)
    return _create_work_from_future(future)


class RecordingGroup(dist.ProcessGroup):
    """A group of ``ranks`` (global) that records each call in :data:`LOG` and completes it at once."""

    def __init__(self, rank: int, size: int, ranks: tuple[int, ...]):
        super().__init__(rank, size)
        self.ranks = ranks

    def _record(self, op: str, tensors, peer: int | None = None) -> None:
        LOG.calls.append(Call(op, self.ranks, _bytes(tensors), peer))

    def getBackendName(self) -> str:  # noqa: N802  (torch's name)
        return BACKEND

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        return self._name

    def allreduce(self, tensors, opts=None):
        self._record("all_reduce", tensors)
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        self._record("all_reduce", tensors)
        return _done(tensors)

    def broadcast(self, tensors, opts=None):
        self._record("broadcast", tensors)
        return _done(tensors)

    def allgather(self, outputs, inputs, opts=None):
        self._record("all_gather", inputs)
        return _done(outputs)

    def _allgather_base(self, output, input, opts=None):
        self._record("all_gather", [input])
        return _done([output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        self._record("all_gather", inputs)
        return _done(outputs)

    def reduce_scatter(self, outputs, inputs, opts=None):
        self._record("reduce_scatter", outputs)
        return _done(outputs)

    def _reduce_scatter_base(self, output, input, opts=None):
        self._record("reduce_scatter", [output])
        return _done([output])

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        self._record("reduce_scatter", outputs)
        return _done(outputs)

    def alltoall_base(self, output, input, output_splits, input_splits, opts=None):
        self._record("all_to_all", [input])
        return _done([output])

    def barrier(self, opts=None):
        self._record("barrier", [])
        return _done([])

    def send(self, tensors, dst: int, tag: int = 0):
        self._record("send", tensors, self.ranks[dst])
        return _done(tensors)

    def recv(self, tensors, src: int, tag: int = 0):
        self._record("recv", tensors, self.ranks[src])
        return _done(tensors)


def _create(options, backend_options):
    ranks = tuple(options.global_ranks_in_group or range(options.group_size))
    LOG.groups.append(ranks)
    return RecordingGroup(options.group_rank, options.group_size, ranks)


def register() -> None:
    """Register the ``"dryrun"`` backend with torch (once per process)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "meta"])


@contextlib.contextmanager
def simulated_rank(rank: int, world_size: int, kernels: dict | None = None):
    """Inside: this process is ``rank`` of ``world_size`` (the launcher's variables, the default group on the
    recording backend), :data:`LOG` emptied; outside again: the group destroyed, the environment as it was.
    ``kernels``: :class:`MetaValues`' cache, kept from one simulated rank to the next."""
    import torch.fx.experimental._config as fx_config
    import torch.nn.parallel.distributed as ddp
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..engines import initialize as init_module

    register()
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                            "MASTER_PORT")}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    verify, ddp._verify_param_shape_across_processes = ddp._verify_param_shape_across_processes, _no_check
    # a refusal: every rank but 0 waits 15 s for rank 0 to print it; here one process says it once (plugin.dryrun)
    speak, init_module.let_rank_0_speak = init_module.let_rank_0_speak, _no_check
    nonzero, fx_config.meta_nonzero_assume_all_nonzero = fx_config.meta_nonzero_assume_all_nonzero, True
    LOG.groups.clear()
    LOG.calls.clear()
    dist.init_process_group(BACKEND, store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with MetaValues(kernels):
            yield LOG
    finally:
        dist.destroy_process_group()
        ddp._verify_param_shape_across_processes = verify
        init_module.let_rank_0_speak = speak
        fx_config.meta_nonzero_assume_all_nonzero = nonzero
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _no_check(*args, **kwargs) -> None:
    return None
