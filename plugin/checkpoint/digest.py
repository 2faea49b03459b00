"""Checksums of a checkpoint's bytes, taken while DCP writes them and checked while a load reads them (never a
second pass over the files).

DCP's file writer writes each item (one piece: a ``torch.save`` of one tensor) at ``stream.tell()`` and asks
``stream.tell()`` again when it is done: :class:`SummingFileSystem` hands it streams that hash everything written
and cut the hash at every ``tell()``, so each item's ``[offset, offset + length)`` gets its own digest (and a file
written without ``tell()``, like ``.metadata``, one digest for the whole). A load then hashes exactly the bytes it
reads, item by item, before ``torch.load`` sees them: a flipped bit in anything a rank reads is named, and nothing
is read twice.

The hash: :mod:`.checksum` (XXH3-64, or crc32 where ``xxhash`` cannot be imported; the manifest records which).
"""
from __future__ import annotations

import io
import os
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystem

from .checksum import Hasher
from .writeback import WriteBehind


class _SummingStream(io.RawIOBase):
    """A binary file opened for writing whose bytes are hashed, the hash cut at every ``tell()``, and written
    behind (:mod:`.writeback`: the disk writes while DCP goes on, the pages leave the cache)."""

    def __init__(self, raw, algorithm: str, record: list):
        self._raw, self._algorithm, self._record = raw, algorithm, record
        self._start = self._pos = 0
        self._h = Hasher(algorithm)
        self._behind = WriteBehind(raw.fileno())

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        self._h.update(view)
        n = self._raw.write(view)
        self._pos += n
        self._behind.written(self._pos)  # up to one buffer (8 KiB) behind the kernel's size: harmless
        return n

    def _cut(self) -> None:
        if self._pos > self._start:
            self._record.append([self._start, self._pos - self._start, self._h.hexdigest()])
            self._start, self._h = self._pos, Hasher(self._algorithm)

    def tell(self) -> int:
        self._cut()
        return self._pos

    def fileno(self) -> int:
        # DCP asks for the descriptor to fsync it, without flushing the stream first (torch 2.13's
        # _write_files_from_queue): the last bytes still in the file object's buffer would miss the fsync
        self._raw.flush()
        return self._raw.fileno()

    def flush(self) -> None:
        if not self._raw.closed:
            self._raw.flush()

    def close(self) -> None:
        if not self.closed:
            self._cut()
            self._raw.flush()
            self._behind.finish()  # after DCP's fsync when sync_files: what is left leaves the cache
            self._raw.close()
        super().close()


class SummingFileSystem(FileSystem):
    """DCP's local file system whose write streams hash what they write: ``items[file name]`` = ``[[offset,
    length, digest], ...]`` in file order once the stream is closed."""

    def __init__(self, algorithm: str):
        super().__init__()
        self.algorithm = algorithm
        self.items: dict[str, list] = {}

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        record = self.items.setdefault(Path(path).name, [])
        record.clear()
        with open(path, mode) as raw:
            stream = _SummingStream(raw, self.algorithm, record)
            try:
                yield stream
            finally:
                stream.close()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        old, new = Path(path).name, Path(new_path).name
        if old in self.items:
            self.items[new] = self.items.pop(old)


def file_record(step_dir: Path, name: str, items: list, algorithm: str) -> dict:
    """The manifest's record of one file: its size (a truncation check that needs no read) and its items' digests."""
    size = os.stat(step_dir / name).st_size
    assert sum(n for _, n, _ in items) == size, f"{name}: the hashed items do not cover the file"
    return {"size": size, "checksum": algorithm, "items": items}
