"""Where a rank's memory lies in the unsharded model's tensors: boxes (global offsets, a view of local storage).

Pure tensor arithmetic, no process group. A rank describes what it holds of a global tensor as *pieces*: a box
of the unsharded tensor (its offsets; its sizes are the view's shape) and a view of the rank's own storage that
holds exactly that box, so a save writes the view and a load fills it in place. Three kinds of sharding compose:

* tensor parallelism (:func:`tp_segments`): a tensor rank's slice, plain, packed (``parts``), padded
  (vocabularies: padding rows are never written or read), replicated (``replicas`` ranks hold each slice, key/value
  heads fewer than the ranks: they write the same box) or transposed (a transformers ``Conv1D`` holds
  ``[in, out]``; the TP layer records that, it is never guessed from shapes);
* what the data-parallel engine keeps of the TP-local tensor: the whole of it (DDP), FSDP2's row range, or a
  DeepSpeed flat range (:func:`flat_range_boxes`);
* :func:`compose` intersects the two into pieces in global coordinates.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class Piece:
    """A box of a global tensor: ``offsets`` in it, and ``view`` (its shape = the box's sizes) in local storage."""

    offsets: tuple[int, ...]
    view: torch.Tensor


@dataclass
class Entry:
    """One global tensor as this rank sees it: its shape and dtype, and the pieces this rank holds (maybe none)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece]
    role: str = "param"  # param | optim | rng
    param: str | None = None
    key: str | None = None


@dataclass
class LocalState:
    """What one rank writes or reads: named entries, callables to run after a load, and JSON scalars."""

    entries: dict[str, Entry]
    after_load: list = field(default_factory=list)
    scalars: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TensorLayout:
    """How a parameter is split over the tensor group (``mark_sharded``'s attributes)."""

    sharded: bool = False
    dim: int = 0
    parts: int = 1
    padding: int = 0
    transposed: bool = False
    replicas: int = 1


def layout_of(param: torch.Tensor) -> TensorLayout:
    """The tensor-parallel layout of a (TP-local) parameter; take it before FSDP2 replaces the parameter."""
    replicas = int(getattr(param, "partition_replicas", 1))
    if not getattr(param, "tensor_model_parallel", False) and replicas == 1:  # a replica past the first is unmarked
        return TensorLayout()
    return TensorLayout(True, int(param.partition_dim), int(getattr(param, "partition_stride", 1)),
                        int(getattr(param, "partition_padding", 0)),
                        bool(getattr(param, "partition_transposed", False)), replicas)


def flat_range_boxes(shape, start: int, end: int) -> list[tuple[int, tuple, tuple]]:
    """Row-major elements ``[start, end)`` of a tensor of ``shape`` as boxes each contiguous in memory:
    ``[(flat_start, offsets, sizes)]`` (at most ``2 * (ndim - 1) + 1`` of them)."""
    shape = tuple(shape)
    if start >= end:
        return []
    if len(shape) <= 1:
        return [(start, (start,) if shape else (), (end - start,) if shape else ())]
    inner = math.prod(shape[1:])
    out = []
    if start % inner:  # a partial first row
        r = start // inner
        stop = min(end, (r + 1) * inner)
        out += [(fs + r * inner, (r,) + off, (1,) + sz)
                for fs, off, sz in flat_range_boxes(shape[1:], start - r * inner, stop - r * inner)]
        start = stop
    r0, r1 = start // inner, end // inner
    if start < end and r1 > r0:  # whole rows
        out.append((start, (r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + shape[1:]))
        start = r1 * inner
    if start < end:  # a partial last row
        out += [(fs + start, (r1,) + off, (1,) + sz) for fs, off, sz in flat_range_boxes(shape[1:], 0, end - start)]
    return out


def flat_held(shape, start: int, flat: torch.Tensor) -> list[tuple[tuple, torch.Tensor]]:
    """Held boxes of a flat fragment ``flat`` = elements ``[start, start + flat.numel())`` of a tensor of ``shape``."""
    return [(off, flat.narrow(0, fs - start, math.prod(sz)).view(sz))
            for fs, off, sz in flat_range_boxes(shape, start, start + flat.numel())]


def tp_segments(local_shape, global_shape, layout: TensorLayout, tp_rank: int = 0, tp_size: int = 1):
    """Where tensor rank ``tp_rank``'s local tensor lies in the global one:
    ``[(local_offsets, sizes, global_offsets, transposed)]``, sizes in local (linear ``[out, in]``) coordinates."""
    local_shape, global_shape = tuple(local_shape), tuple(global_shape)
    zero = (0,) * len(local_shape)
    if not layout.sharded or tp_size == 1:
        want = tuple(reversed(global_shape)) if layout.transposed else global_shape
        if local_shape != want:
            raise ValueError(f"local tensor {local_shape} is not the whole tensor {global_shape}")
        return [(zero, local_shape, zero, layout.transposed)]
    tp_rank, tp_size = tp_rank // layout.replicas, tp_size // layout.replicas  # the slice held, of how many
    dim, n = layout.dim, local_shape[layout.dim]
    linear = list(local_shape)
    linear[dim] = n * tp_size - layout.padding
    want = tuple(reversed(global_shape)) if layout.transposed else global_shape
    if tuple(linear) != want:
        raise ValueError(f"a shard {local_shape} over {tp_size} tensor ranks gives {tuple(linear)}, not {want}")
    segs = []
    if layout.parts > 1:  # packed: part j of the dimension, each part split on its own
        s, whole = n // layout.parts, n * tp_size // layout.parts
        for j in range(layout.parts):
            lo, go, sz = list(zero), list(zero), list(local_shape)
            lo[dim], go[dim], sz[dim] = j * s, j * whole + tp_rank * s, s
            segs.append((tuple(lo), tuple(sz), tuple(go), layout.transposed))
    else:  # plain or padded: padding rows are not part of the global tensor
        real = max(0, min(n, linear[dim] - tp_rank * n))
        if real:
            go, sz = list(zero), list(local_shape)
            go[dim], sz[dim] = tp_rank * n, real
            segs.append((zero, tuple(sz), tuple(go), layout.transposed))
    return segs


def compose(held, segments) -> list[Piece]:
    """``held``: ``[(offsets in the TP-local tensor, view)]``; ``segments``: :func:`tp_segments`. -> global pieces."""
    out = []
    for h_off, view in held:
        h_size = tuple(view.shape)
        for s_off, s_size, g_off, transposed in segments:
            lo = [max(a, b) for a, b in zip(h_off, s_off, strict=True)]
            hi = [min(a + x, b + y) for a, x, b, y in zip(h_off, h_size, s_off, s_size, strict=True)]
            if h_size and any(low >= high for low, high in zip(lo, hi, strict=True)):
                continue
            v = view
            for d, (low, high) in enumerate(zip(lo, hi, strict=True)):
                v = v.narrow(d, low - h_off[d], high - low)
            g = tuple(go + low - so for go, low, so in zip(g_off, lo, s_off, strict=True))
            if transposed:
                v, g = v.t(), tuple(reversed(g))
            out.append(Piece(g, v))
    return out


def box(t: torch.Tensor, offsets, sizes) -> torch.Tensor:
    """The view of ``t`` that starts at ``offsets`` and spans ``sizes`` (one piece's place in a tensor)."""
    for d, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
        t = t.narrow(d, o, n)
    return t


def whole_held(t: torch.Tensor) -> list[tuple[tuple, torch.Tensor]]:
    return [((0,) * t.dim(), t)]


def dtensor_held(t) -> list[tuple[tuple, torch.Tensor]]:
    """An FSDP2 DTensor's local shard as held boxes of the TP-local tensor (``detach``: DCP copies into it in place,
    which an autograd view refuses)."""
    local = t.detach().to_local()
    if local.numel() == 0:
        return []
    (chunk,) = t.__create_chunk_list__()
    return [(tuple(chunk.offsets), local)]
