"""What each back end does with a unit's whole (or tensor-parallel cut) tensors: the sinks of :func:`.run.materialize`.

* :class:`PlainSink`: a new ``Parameter`` swapped in for the meta one in every module that holds it (ties stay
  ties) with the meta parameter's attributes copied (``tensor_model_parallel``, ``partition_dim``,
  ``ds_pipe_replicated``...). Not ``Module.to_empty()``: that makes new parameters without those attributes and
  unties tied weights. DDP, ZeroRedundancyOptimizer, pipeline stages, DeepSpeed ZeRO 0-2, Accelerate.
* :class:`FSDP2Sink`: after ``fully_shard`` on meta, the FSDP2 root's ``to_empty`` (FSDP2 re-registers its sharded
  DTensors), then each parameter's local shard copied from its part of the whole tensor (:func:`_local_piece`,
  ``distribute_tensor``'s split as a view): every rank slices its own copy, nothing is sent or cloned.
* :class:`Zero3Sink`: the whole tensors swapped in (cast to the engine's dtype: DeepSpeed does not cast a model
  it finds partitioned), then partitioned at once over the data group: ``deepspeed.zero.Init(module=...)`` for the
  first unit, ``convert_to_zero_parameters`` for the others (DeepSpeed's own route for late parameters).

With a weights source (``materialize(source=...)``), a sharding sink reads the files itself: ``takes_piece`` says
which tensors it shards (their whole values from the files are skipped), and after the unit is sharded
``read_piece(live, kind, key, read)`` overwrites this rank's shard with ``read(box=...)`` (FSDP2) or
``read(flat=...)`` (ZeRO-3), the files' values of exactly that piece. :class:`PlainSink` has neither: it takes the
whole (or cut) tensors.
"""
from __future__ import annotations

import torch
from torch import nn


class PlainSink:
    def __init__(self, root: nn.Module, dtype: torch.dtype | None = None, device: torch.device | None = None):
        self.root, self.dtype, self.device = root, dtype, device
        self.holders: dict[int, list[tuple[nn.Module, str]]] | None = None

    def prepare(self) -> None:
        self.holders = {}
        for m in self.root.modules():
            for table in (m._parameters, m._buffers):
                for k, t in table.items():
                    if t is not None and t.device.type == "meta":
                        self.holders.setdefault(id(t), []).append((m, k))

    def _value(self, value: torch.Tensor) -> torch.Tensor:
        if self.dtype is not None and value.is_floating_point():
            value = value.to(self.dtype)
        return value.to(self.device) if self.device is not None else value

    def put(self, live: nn.Module, kind: str, key: str, value: torch.Tensor):
        old = (live._parameters if kind == "param" else live._buffers)[key]
        value = _own_storage(self._value(value))
        if kind == "param":
            new = nn.Parameter(value, requires_grad=old.requires_grad)
            new.__dict__.update(old.__dict__)  # the marks the plan and the pipeline set on the meta parameter
        else:
            new = value
        for m, k in self.holders.pop(id(old), [(live, key)]):
            (m._parameters if kind == "param" else m._buffers)[k] = new
        return new if kind == "param" else None

    def finish_unit(self, live: nn.Module, params: list) -> None:
        pass

    def close(self) -> None:
        pass


def _own_storage(value: torch.Tensor) -> torch.Tensor:
    """``value`` itself when it is the whole of its storage (the unit's fresh dense tensor: the twin is dropped
    after the unit, so nothing else keeps it), else a copy: a cut may return a view of the whole tensor, which
    would keep the whole storage alive. Copying every time made the largest unit twice over (an embedding's
    vocab x hidden, the peak of the whole materialisation) for nothing."""
    if value.untyped_storage().nbytes() == value.numel() * value.element_size() and value.storage_offset() == 0:
        return value
    return value.clone()


class FSDP2Sink:
    def __init__(self, fsdp_root: nn.Module, device: torch.device):
        self.fsdp_root, self.device = fsdp_root, device

    def prepare(self) -> None:
        self.fsdp_root.to_empty(device=self.device)

    def put(self, live: nn.Module, kind: str, key: str, value: torch.Tensor):
        from torch.distributed.tensor import DTensor

        target = (live._parameters if kind == "param" else live._buffers)[key]
        with torch.no_grad():
            if isinstance(target, DTensor):
                local = target.to_local()
                piece = _local_piece(value, target)
                assert piece.shape == local.shape, (key, piece.shape, local.shape)  # internal invariant
                local.copy_(piece)
            else:
                target.copy_(value)
        return None

    def takes_piece(self, live: nn.Module, kind: str, key: str) -> bool:
        """A DTensor placed by plain ``Shard``/``Replicate`` only (FSDP2's dim-0 chunks, HSDP): its local part is
        one box of the whole tensor. Not a ``_StridedShard`` (FSDP2 over a tensor-parallel DTensor)."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        target = (live._parameters if kind == "param" else live._buffers)[key]
        return isinstance(target, DTensor) and all(type(p) in (Shard, Replicate) for p in target.placements)

    def read_piece(self, live: nn.Module, kind: str, key: str, read) -> None:
        """Overwrite this rank's local shard with the box of the whole tensor it holds, ``read(box=...)``: the
        rows of torch.chunk's dim-0 split, as ``distribute_tensor`` would cut them (DTensor's own offsets)."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        target = (live._parameters if kind == "param" else live._buffers)[key]
        shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        local = target.to_local()
        assert tuple(local.shape) == tuple(shape), (key, tuple(local.shape), shape)
        if local.numel():
            with torch.no_grad():
                local.copy_(read(box=tuple((o, o + n) for o, n in zip(offset, shape, strict=True))))

    def finish_unit(self, live: nn.Module, params: list) -> None:
        pass

    def close(self) -> None:
        pass


def _local_piece(value: torch.Tensor, target) -> torch.Tensor:
    """This rank's part of the whole ``value`` for the DTensor ``target``: a view, nothing copied or sent.

    For ``Replicate`` and plain ``Shard(d)`` placements it is ``distribute_tensor``'s own split (``torch.chunk``
    along ``d`` per mesh dimension, in order; a rank past the last chunk gets an empty one), which is FSDP2's dim-0
    chunking. Not ``distribute_tensor`` itself: with ``src_data_rank=None`` it clones the local chunk, a transient
    second copy of the shard on top of the whole unit (measured: the head's 39 MB per rank at the peak). Other
    placements (tensor parallel's ``_StridedShard``) go through ``distribute_tensor``, which knows them."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh, placements = target.device_mesh, target.placements
    if not all(type(p) in (Replicate, Shard) for p in placements):
        return distribute_tensor(value, mesh, placements, src_data_rank=None).to_local()
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "an FSDP2 parameter on a mesh this rank is not in"  # internal invariant
    piece = value
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            dim = placement.dim % value.ndim
            chunks = torch.chunk(piece, mesh.size(mesh_dim), dim=dim)
            index = coordinate[mesh_dim]
            piece = chunks[index] if index < len(chunks) else piece.narrow(dim, piece.size(dim), 0)
    return piece


class Zero3Sink(PlainSink):
    def __init__(self, root: nn.Module, ds_config: dict, data_group, mpu, dtype: torch.dtype | None,
                 device: torch.device):
        super().__init__(root, dtype=dtype, device=device)
        self.ds_config, self.data_group, self.mpu = ds_config, data_group, mpu
        self.first = None

    def finish_unit(self, live: nn.Module, params: list) -> None:
        import deepspeed

        if not params:
            return
        if self.first is None:
            holder = nn.Module()  # Init(module=) converts a module's parameters: these ones, not the live children's
            for i, p in enumerate(params):
                holder.register_parameter(f"p{i}", p)
            deepspeed.zero.Init(module=holder, config_dict_or_path=self.ds_config,
                                data_parallel_group=self.data_group, mpu=self.mpu)
            self.first = params[0]
        else:
            self.first.convert_to_zero_parameters(param_list=params)

    def takes_piece(self, live: nn.Module, kind: str, key: str) -> bool:
        """A parameter (partitioned by :meth:`finish_unit`; a buffer stays whole), unless the partition is not
        plain flat ranges of ``ds_tensor``: parameters offloaded to NVMe, ZeRO++'s secondary partition, quantized
        weights. Those read whole, as before."""
        z = self.ds_config.get("zero_optimization", {})
        plain = ((z.get("offload_param") or {}).get("device") != "nvme" and (z.get("zero_hpz_partition_size") or 1) <= 1
                 and not z.get("zero_quantized_weights") and not z.get("zero_quantized_nontrainable_weights"))
        return kind == "param" and plain

    def read_piece(self, live: nn.Module, kind: str, key: str, read) -> None:
        """Overwrite this rank's partition ``ds_tensor`` with its flat range of the whole tensor, ``read(flat=...)``:
        DeepSpeed's ``_partition_param`` gives rank r of the partition group the elements ``[r * n, (r + 1) * n)``
        of the flattened tensor, ``n = ceil(numel / world)``, the last rank's tail padding (left as it is)."""
        import torch.distributed as dist

        param = live._parameters[key]
        part = param.ds_tensor
        start = part.ds_numel * dist.get_rank(group=param.ds_process_group)
        stop = min(start + part.ds_numel, param.ds_numel)
        if start < stop:
            with torch.no_grad():
                part.narrow(0, 0, stop - start).copy_(read(flat=(start, stop)))
