"""A weights source for the sharded initialisation: a unit filled from ``save_pretrained`` safetensors files, each
rank reading only its part.

``plugin.initialize(meta_model_or_builder, recipe, weights=DIR)``: ``DIR`` holds ``*.safetensors`` (one file, or
shards with ``model.safetensors.index.json``), tensors named as the model's ``state_dict`` (what ``save_pretrained``
writes; a head tied to the embeddings is stored once, under the embedding's name, which is the unit that owns it
here too). :meth:`SafetensorsWeights.check` runs in ``initialize`` before any process group: every parameter of the
model must be there with its shape (a persistent buffer too, when the files hold it; a non-persistent one, such as
rotary tables, keeps its init), from the files' headers only. Refused with the tensor's name: a missing tensor, a
shape that differs, and a directory of ``.bin`` files (pickles, which run code on load).

Filling (:meth:`SafetensorsWeights.fill`, called by :func:`plugin.materialize.run.materialize` after a unit's init
call, on its dense twin): only held units are filled (a pipeline rank reads its stage's tensors only). Where the
tensor-parallel plan cuts the unit, the part the cut keeps is found by running the cut once on a probe (each element
of the tensor coded by its flat index + 1, in float64: exact below 2**53 elements) and read as one box of the tensor
(``safe_open(...).get_slice(...)``), or as runs of rows when the kept part is not one box (a fused QKV column cut
keeps three blocks of rows); the rest of the dense twin stays as the init left it, and the cut drops it. A unit
without a cut (replicated, or no tensor parallelism) reads its tensors whole, unless the sink shards it (FSDP2,
DeepSpeed ZeRO-3): then ``fill`` skips those tensors and the sink, once it has sharded the unit, asks
:meth:`SafetensorsWeights.read` for its piece only (FSDP2: a box of rows; ZeRO-3: a flat range, read as the rows that
cover it, then cut).
:attr:`SafetensorsWeights.bytes_read` counts the bytes this rank asked the files for.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import PluginError

INDEX = "model.safetensors.index.json"


class SafetensorsWeights:
    """The tensors of a ``save_pretrained`` directory, opened lazily; counts the bytes read."""

    def __init__(self, directory):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise PluginError(f"initialize(weights={str(directory)!r}): not a directory -> pass the directory "
                              "model.save_pretrained(dir) wrote (config.json and *.safetensors)")
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            pickles = sorted(p.name for p in self.dir.glob("*.bin"))
            why = (f"it holds {pickles[:3]}: pickle files, which run code when loaded, are not read"
                   if pickles else "it holds no *.safetensors file")
            raise PluginError(f"initialize(weights={str(self.dir)!r}): {why} -> save the weights as safetensors: "
                              "model.save_pretrained(dir) (safe_serialization is transformers' default)")
        from safetensors import safe_open

        self._open, self._handles = safe_open, {}
        index = self.dir / INDEX
        if index.exists():
            self.file_of = {k: self.dir / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            self.file_of = {k: f for f in files for k in self._handle(f).keys()}
        self.bytes_read = 0

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = self._open(str(path), framework="pt")
        return self._handles[path]

    def _slice(self, name: str):
        return self._handle(self.file_of[name]).get_slice(name)

    def check(self, units) -> None:
        """Every owned parameter is in the files with its shape (headers only); raises naming what is wrong."""
        problems = []
        for unit in units:
            for kind, key in unit.owned:
                name = f"{unit.name}.{key}" if unit.name else key
                t = (unit.template._parameters if kind == "param" else unit.template._buffers)[key]
                if name not in self.file_of:
                    if kind == "param":
                        problems.append(f"{name} {tuple(t.shape)} is not in the files")
                    continue
                shape = tuple(self._slice(name).get_shape())
                if shape != tuple(t.shape):
                    problems.append(f"{name}: the files hold shape {shape}, the model {tuple(t.shape)}")
        if problems:
            raise PluginError(f"initialize(weights={str(self.dir)!r}): {len(problems)} tensor(s) do not fit the model: "
                              f"{'; '.join(problems[:5])} -> build the model from the config.json saved with these "
                              "weights (the same architecture and sizes)")

    def holds(self, unit, key: str) -> bool:
        """Whether the files hold ``unit``'s tensor ``key`` (a non-persistent buffer is not there)."""
        return _name(unit, key) in self.file_of

    def read(self, unit, key: str, box=None, flat=None) -> torch.Tensor:
        """``unit``'s tensor ``key`` from the files, in the files' dtype: whole; or ``box`` (per dimension
        ``(start, stop)``), that box; or ``flat`` (``(start, stop)`` of the flattened tensor), those elements, read
        as the rows that cover them (a 1-D tensor's rows are its elements) and then cut."""
        sl = self._slice(_name(unit, key))
        shape = tuple(sl.get_shape())
        if flat is not None and shape:
            row = 1
            for n in shape[1:]:
                row *= n
            row = row or 1
            first = min(flat[0] // row, shape[0])
            last = first if flat[1] <= flat[0] else -(-flat[1] // row)
            rows = sl[first:last]
            self.bytes_read += rows.numel() * rows.element_size()
            return rows.reshape(-1)[flat[0] - first * row:flat[1] - first * row]
        value = sl[tuple(slice(a, b) for a, b in box)] if box is not None else sl[:]
        self.bytes_read += value.numel() * value.element_size()
        return value.reshape(-1)[flat[0]:flat[1]] if flat is not None else value

    @torch.no_grad()
    def fill(self, unit, dense: torch.nn.Module, cut=None, skip=()) -> None:
        """Overwrite ``dense``'s owned tensors that the files hold with their values: the part ``cut`` keeps, or
        the whole tensor without a cut. ``skip``: ``(kind, key)`` pairs left at their init (a sink reads their
        pieces itself, :func:`plugin.materialize.run.materialize`)."""
        for kind, key in unit.owned:
            name = _name(unit, key)
            if name not in self.file_of or (kind, key) in skip:
                continue  # a non-persistent buffer (checked: every parameter is there), or read by the sink
            target = (dense._parameters if kind == "param" else dense._buffers)[key]
            for box in (_kept_boxes(dense, kind, key, cut) if cut is not None else [None]):
                sl = self._slice(name)
                if box is None:
                    value, where = sl[:], (slice(None),) * target.dim()
                else:
                    where = tuple(slice(a, b) for a, b in box)
                    value = sl[where]
                self.bytes_read += value.numel() * value.element_size()
                target[where].copy_(value.to(target.dtype))


def _name(unit, key: str) -> str:
    return f"{unit.name}.{key}" if unit.name else key


def _kept_boxes(dense: torch.nn.Module, kind: str, key: str, cut) -> list[tuple[tuple[int, int], ...]]:
    """The boxes (per dimension ``[start, stop)``) of ``dense``'s tensor ``key`` that ``cut`` keeps, found by cutting a
    probe whose elements are their flat index + 1 (0 is what a cut pads with)."""
    import copy

    table = dense._parameters if kind == "param" else dense._buffers
    t = table[key]
    if t.dim() == 0 or t.numel() >= 2 ** 53:
        return [tuple((0, n) for n in t.shape)]
    probe = copy.copy(dense)
    probe._parameters, probe._buffers = dict(dense._parameters), dict(dense._buffers)
    codes = torch.arange(1, t.numel() + 1, dtype=torch.float64).reshape(t.shape)
    if kind == "param":
        probe._parameters[key] = torch.nn.Parameter(codes, requires_grad=False)
    else:
        probe._buffers[key] = codes
    piece = cut(probe)
    kept = (piece._parameters if kind == "param" else piece._buffers)[key].detach().flatten()
    kept = torch.unique(kept[kept > 0].long() - 1)
    if kept.numel() == 0:
        return []
    idx = torch.stack(torch.unravel_index(kept, t.shape), dim=1) if t.dim() > 1 else kept[:, None]
    box = _box(idx)
    if _count(box) == kept.numel():
        return [box]
    boxes, rows = [], torch.unique(idx[:, 0])  # runs of consecutive rows, each one box
    start = prev = int(rows[0])
    for r in [*map(int, rows[1:]), None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        run = idx[(idx[:, 0] >= start) & (idx[:, 0] <= prev)]
        boxes.append(_box(run))
        if r is not None:
            start = prev = r
    if sum(_count(b) for b in boxes) != kept.numel():  # not runs of boxes either: read the whole tensor
        return [tuple((0, n) for n in t.shape)]
    return boxes


def _box(idx: torch.Tensor) -> tuple[tuple[int, int], ...]:
    return tuple((int(idx[:, d].min()), int(idx[:, d].max()) + 1) for d in range(idx.shape[1]))


def _count(box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n
