"""One DCP item's bytes as a tensor: a view of the bytes already read, without ``torch.load``.

DCP's file writer stores each item as a ``torch.save`` zip of one tensor; the plugin's save planner hands it only
row-major contiguous tensors (:class:`~.dcp_io.PieceSavePlanner`), and DCP clones any whose storage is larger,
so the zip's one stored ``*/data/N`` record is exactly the chunk's bytes, row-major. The shape and dtype are the
chunk's, from DCP's metadata: nothing is unpickled. :func:`item_tensor` finds that record through the zip's
central directory and returns ``torch.frombuffer`` of it, or None for anything else (compressed, zip64, another
record layout, a size that does not match): the caller then falls back to ``torch.load(weights_only=True)``.
This saves ``torch.load``'s copy of every byte into a new storage and its per-item unpickling.
"""
from __future__ import annotations

import math
import struct
import sys

import torch

_EOCD, _CDIR, _LOCAL = b"PK\x05\x06", b"PK\x01\x02", b"PK\x03\x04"


def _data_record(buf: memoryview) -> tuple[int, int] | None:
    """``(offset, size)`` in ``buf`` of the one stored ``data/`` record of a torch.save zip, or None."""
    n = len(buf)
    tail = bytes(buf[max(0, n - 65558):])
    at = tail.rfind(_EOCD)
    if at < 0 or len(tail) - at < 22:
        return None
    entries, cd_size, cd_offset = struct.unpack_from("<HII", tail, at + 10)
    if cd_offset == 0xFFFFFFFF or entries == 0xFFFF or cd_offset + cd_size > n:  # zip64: not worth parsing here
        return None
    cd = bytes(buf[cd_offset: cd_offset + cd_size])
    pos, found = 0, []
    for _ in range(entries):
        if cd[pos: pos + 4] != _CDIR:
            return None
        method, = struct.unpack_from("<H", cd, pos + 10)
        csize, usize, name_len, extra_len, comment_len = struct.unpack_from("<IIHHH", cd, pos + 20)
        local, = struct.unpack_from("<I", cd, pos + 42)
        name = cd[pos + 46: pos + 46 + name_len]
        if b"/data/" in name and not name.endswith(b"serialization_id"):
            found.append((method, csize, usize, local))
        pos += 46 + name_len + extra_len + comment_len
    if len(found) != 1:
        return None
    method, csize, usize, local = found[0]
    if method != 0 or csize != usize or csize == 0xFFFFFFFF or bytes(buf[local: local + 4]) != _LOCAL:
        return None
    name_len, extra_len = struct.unpack_from("<HH", buf, local + 26)
    start = local + 30 + name_len + extra_len
    return (start, csize) if start + csize <= n else None


def item_tensor(buf: memoryview, dtype: torch.dtype, shape) -> torch.Tensor | None:
    """The tensor of ``shape`` and ``dtype`` an item's bytes ``buf`` hold (a view of ``buf``), or None."""
    if sys.byteorder != "little":
        return None
    count = math.prod(shape)
    if count == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    found = _data_record(buf)
    if found is None or found[1] != count * dtype.itemsize:
        return None
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=found[0]).view(tuple(shape))
