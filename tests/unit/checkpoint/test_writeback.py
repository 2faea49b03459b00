"""Write-behind (plugin/checkpoint/writeback.py) on real files: the bytes are all there, the file leaves the page
cache as it is written (counted with mincore), and a checkpoint stream's fsync covers its last bytes; and the
load's read-ahead (dcp_io.ReadAhead): exactly the items read, a window ahead."""
from __future__ import annotations

import ctypes
import mmap
import os

import pytest

from plugin.checkpoint import writeback
from plugin.checkpoint.digest import SummingFileSystem
from plugin.checkpoint.writeback import WriteBehind

MiB = 1 << 20


def _resident_fraction(path) -> float:
    """Fraction of the file's pages in the page cache: mincore over a read-only shared mapping (libc's mmap:
    Python's mmap object gives no address)."""
    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = ctypes.create_string_buffer(pages)
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            assert libc.mincore(ctypes.c_void_p(addr), size, vec) == 0, ctypes.get_errno()
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    return sum(b & 1 for b in vec.raw) / pages


def _write(path, behind: bool, total=8 * MiB, chunk=256 * 1024):
    data = bytes(range(256)) * (chunk // 256)
    with open(path, "wb", buffering=0) as f:
        wb = WriteBehind(f.fileno(), window=MiB)
        wb.enabled = wb.enabled and behind
        pos = 0
        while pos < total:
            pos += f.write(data)
            wb.written(pos)
        os.fsync(f.fileno())
        wb.finish()
    return data


@pytest.mark.skipif(not writeback.available(), reason="no sync_file_range here (not Linux)")
def test_the_file_leaves_the_cache_and_keeps_its_bytes(tmp_path):
    plain, behind = tmp_path / "plain", tmp_path / "behind"
    data = _write(plain, behind=False)
    _write(behind, behind=True)
    if _resident_fraction(plain) < 0.9:
        pytest.skip("this file system does not keep written files in the page cache")
    assert _resident_fraction(behind) < 0.1
    assert behind.read_bytes() == plain.read_bytes() == data * 32


def test_windows_advance_in_order(tmp_path):
    calls = []
    with open(tmp_path / "f", "wb") as f:
        wb = WriteBehind(f.fileno(), window=100)
        wb.enabled = True
        wb._call = lambda off, n, flags: calls.append(("sync", off, n, flags))
        wb._drop = lambda off, end: calls.append(("drop", off, end))
        for size in (50, 120, 250, 260, 420, 990):
            wb.written(size)
    # each window's writeback starts once it is written; every window but the newest (in flight) is then waited
    # for (flags 7: WAIT_BEFORE | WRITE | WAIT_AFTER) and dropped from the cache
    assert calls == [("sync", 0, 100, 2),                                        # 120
                     ("sync", 100, 100, 2), ("sync", 0, 100, 7), ("drop", 0, 100),  # 250
                     ("sync", 200, 200, 2), ("sync", 100, 200, 7), ("drop", 100, 300),  # 420
                     ("sync", 400, 500, 2), ("sync", 300, 500, 7), ("drop", 300, 800)]  # 990


def test_a_file_system_without_it_falls_back_to_fsync_alone(tmp_path):
    r, w = os.pipe()  # sync_file_range fails on a pipe (ESPIPE): write-behind stops, nothing raises
    try:
        wb = WriteBehind(w, window=4)
        wb.written(8)
        assert not wb.enabled or not writeback.available()
        wb.written(100)
        wb.finish()
    finally:
        os.close(r)
        os.close(w)


def test_the_fsync_descriptor_has_every_byte(tmp_path):
    """DCP fsyncs ``stream.fileno()`` without flushing the stream first: the stream flushes when asked for it."""
    fs = SummingFileSystem("crc32")
    path = tmp_path / "x.distcp"
    with fs.create_stream(path, "wb") as stream:
        stream.write(b"a" * 100)  # stays in the file object's buffer (8 KiB)
        fd = stream.fileno()
        assert os.fstat(fd).st_size == 100


def test_read_ahead_asks_for_exactly_the_items_read_a_window_ahead(monkeypatch):
    from plugin.checkpoint import dcp_io

    asked = []
    monkeypatch.setattr(dcp_io.os, "posix_fadvise", lambda fd, off, n, advice: asked.append((off, n, advice)))
    # items of 40 bytes with gaps (a resharding load reads part of a file): a window of 100 bytes
    spans = [(0, 40), (50, 40), (100, 40), (400, 40), (450, 40)]
    ahead = dcp_io.ReadAhead(3, spans, window=100)
    ahead.before(0)
    assert asked == [(0, 40, os.POSIX_FADV_WILLNEED), (50, 40, os.POSIX_FADV_WILLNEED)]  # 140 - 0 > 100: not yet
    ahead.before(1)
    assert asked[2:] == [(100, 40, os.POSIX_FADV_WILLNEED)]
    ahead.before(2)
    assert asked[3:] == []  # 440 - 100 > 100
    ahead.before(3)
    assert asked[3:] == [(400, 40, os.POSIX_FADV_WILLNEED), (450, 40, os.POSIX_FADV_WILLNEED)]
    ahead.before(4)
    assert len(asked) == 5  # each item asked for once
