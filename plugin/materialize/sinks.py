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
