"""Where the dry run meets torch: a recording process group, values read from meta tensors, one simulated rank's
world.

* :class:`RecordingGroup`: a Python ``ProcessGroup`` registered as torch's backend ``"dryrun"`` (the way
  ``torch.testing._internal.distributed.fake_pg`` registers its fake one). Every collective and point-to-point
  call of every group reaches it, from Python (``dist.all_reduce``, the pipeline's ``batch_isend_irecv``) or from
  C++ (DDP's reducer, ``ZeroRedundancyOptimizer``, FSDP2's all-gathers): it records the op, the group's global
  ranks, the bytes and the peer, and completes at once with the tensors as they are. torch's own
  ``FakeProcessGroup`` completes with a future of None, which DDP's reducer refuses; this one hands the tensors
  back, as a real backend does.
* :class:`MetaValues`: a dispatch mode that answers what a step reads from a tensor (``.item()``, ``.tolist()``, a
  copy to the CPU, ``torch.equal``) on meta tensors, which hold no values: zeros, and unequal.
* Pipeline stages exchange their tensors' metadata once, on their first step (``recv_object_list``, pickled
  objects whose bytes meta cannot carry): :class:`StageMetadata` hands a stage's forward metadata to the next
  stage's simulation (ranks are simulated in rank order, stage by stage; the data coordinate does not change it),
  and answers the backward metadata as a stage without user-given shapes derives it (the gradients of its outputs,
  shaped as the outputs).
* :func:`simulated_rank`: the environment of one rank of the job (``RANK``, ``WORLD_SIZE``), the default group
  on the recording backend, and DDP's start-up check of parameter shapes across ranks turned off (an all-gather
  whose answer it reads, which meta cannot give: the dry run compares the ranks itself, :mod:`.checks`).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.utils._python_dispatch import TorchDispatchMode

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


class MissingStage(RuntimeError):
    """A pipeline stage's simulation needs the forward metadata of the stage before it, not simulated yet."""


class StageMetadata:
    """What pipeline stages would send each other as pickled objects on their first step, kept across the
    simulated ranks of one dry run: keyed by (from stage, to stage, the rank's place within its stage)."""

    def __init__(self) -> None:
        self.forward: dict = {}

    @contextlib.contextmanager
    def patched(self, inner: int):
        """Inside: ``PipelineStage``'s metadata send and receive go through this object; ``inner`` is the number of
        ranks of one stage of one replica (tensor x context), so that ``rank % inner`` is a rank's place."""
        from torch.distributed.pipelining import stage as stage_module
        from torch.distributed.pipelining._utils import _StageBackwardMeta, _StageForwardMeta

        cls = stage_module.PipelineStage
        send, recv = cls._send_meta, cls._recv_meta
        forward = self.forward

        def send_meta(stage, meta, dst_stage):
            if isinstance(meta, _StageForwardMeta):
                forward[(stage.stage_index, dst_stage, dist.get_rank() % inner)] = meta

        def recv_meta(stage, src_stage):
            if src_stage > stage.stage_index:  # the backward metadata: the gradients of this stage's outputs
                return _StageBackwardMeta(backward_metas=stage_module._derive_grad_metas(stage._stage_meta.outputs))
            key = (src_stage, stage.stage_index, dist.get_rank() % inner)
            if key not in forward:
                raise MissingStage(f"pipeline stage {stage.stage_index} takes its input shapes from stage {src_stage}, "
                                   "which this dry run has not simulated yet")
            return forward[key]

        cls._send_meta, cls._recv_meta = send_meta, recv_meta
        try:
            yield
        finally:
            cls._send_meta, cls._recv_meta = send, recv


_RESHAPES = {"resize_", "resize_as_", "set_", "as_strided_", "squeeze_", "unsqueeze_", "transpose_", "t_",
             "swapdims_", "swapaxes_", "detach_"}


def _kind(func) -> str | None:
    """``"new"``: ``func`` returns new tensors only (no argument mutated, no output aliasing an input); ``"inplace"``:
    it writes its first argument only (a tensor, or a list of them for the ``_foreach_*_`` ops), whose shape it keeps,
    and returns that argument or nothing; None: anything else (views, ``out=``, shape changes), run every time."""
    schema = func._schema
    if not schema.is_mutable:
        return "new" if schema.returns and all(r.alias_info is None for r in schema.returns) else None
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if func._opname in _RESHAPES or schema.overload_name.startswith("out") or len(written) != 1 \
            or written[0] is not schema.arguments[0]:
        return None
    returns = schema.returns
    if not returns or (len(returns) == 1 and returns[0].alias_info is not None and returns[0].alias_info.is_write):
        return "inplace"
    return None


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _key(value):
    """A hashable description of an argument: a meta tensor by its shape, strides and dtype."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "meta" or value.is_sparse or type(value) not in _PLAIN:
            raise _Uncacheable
        return ("T", tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_key(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _key(v)) for k, v in sorted(value.items()))
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                           torch.memory_format)):
        return value
    raise _Uncacheable


class _Uncacheable(Exception):
    pass


class MetaValues(TorchDispatchMode):
    """Reads of values from meta tensors answered as zeros (``.item()``, ``.tolist()``, a copy off meta) and
    ``torch.equal`` as False; every other op runs as it is.

    And a cache of meta kernels, most of which torch writes in Python (its reference decompositions): a functional op
    (nothing mutated, no output a view of an input) on meta tensors of the shapes, strides and dtypes seen before
    gives new meta tensors of the shapes it gave then, without running the kernel again. Every micro-batch, layer and
    rank of a dry run repeats the same few hundred ops, so this is what makes a rank take seconds."""

    def __init__(self, cache: dict | None = None) -> None:
        super().__init__()
        self.cache = {} if cache is None else cache  # func -> {argument key: output spec}; False: not functional

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.device.type == "meta":
            if func is torch.ops.aten._local_scalar_dense.default:
                return 0.0 if first.is_floating_point() else 0
            if func is torch.ops.aten.equal.default:
                return False
            if func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None \
                    and torch.device(kwargs["device"]).type != "meta":
                return torch.zeros(first.shape, dtype=kwargs.get("dtype") or first.dtype, device=kwargs["device"])
        entry = self.cache.get(func)
        if entry is None:
            kind = _kind(func)
            entry = self.cache[func] = (kind, {}) if kind else False
        if entry is not False:
            kind, cached = entry
            try:
                key = (_key(args), _key(kwargs))
            except _Uncacheable:
                key = None
            if key is not None:
                spec = cached.get(key)
                if spec is not None:  # seen before: the kernel checked these shapes then
                    if kind == "inplace":
                        return args[0] if func._schema.returns else None
                    return _make(spec)
                out = func(*args, **kwargs)
                spec = True if kind == "inplace" else _spec(out)
                if spec is not None:
                    cached[key] = spec
                return out
        return func(*args, **kwargs)


def _spec(out):
    if isinstance(out, torch.Tensor):
        if out.device.type != "meta" or type(out) is not torch.Tensor:
            return None
        return ("T", tuple(out.shape), out.stride(), out.dtype)
    if isinstance(out, (tuple, list)) and out:
        specs = [_spec(o) for o in out]
        return None if any(s is None for s in specs) else ("L", tuple(specs))
    return None


def _make(spec):
    if spec[0] == "T":
        return torch.empty_strided(spec[1], spec[2], dtype=spec[3], device="meta")
    return tuple(_make(s) for s in spec[1])


@contextlib.contextmanager
def simulated_rank(rank: int, world_size: int, kernels: dict | None = None):
    """Inside: this process is ``rank`` of ``world_size`` (the launcher's variables, the default group on the
    recording backend), :data:`LOG` emptied; outside again: the group destroyed, the environment as it was.
    ``kernels``: :class:`MetaValues`' cache, kept from one simulated rank to the next."""
    import torch.fx.experimental._config as fx_config
    import torch.nn.parallel.distributed as ddp
    from torch.testing._internal.distributed.fake_pg import FakeStore

    register()
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                            "MASTER_PORT")}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    verify, ddp._verify_param_shape_across_processes = ddp._verify_param_shape_across_processes, _no_check
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
        fx_config.meta_nonzero_assume_all_nonzero = nonzero
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _no_check(*args, **kwargs) -> None:
    return None
