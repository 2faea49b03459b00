"""Every byte of a step directory against the checksums its manifest recorded (pure: no torch, nothing unpickled,
no process group): ``python -m plugin checkpoint verify DIR``.

The manifest records, for every file DCP wrote (each rank's ``.distcp``, and ``.metadata``), its size and the
``[offset, length, digest]`` of each item, taken while the bytes were written (:mod:`.digest`). A load checks the
items a rank reads and stops at the first bad one; :func:`verify` reads every file once, front to back, item by
item through one reused buffer of at most ``chunk`` bytes (memory stays bounded whatever the sizes of files and
items), and returns every damaged file and item at once.

The hash is the one :mod:`.digest` takes (XXH3-64 through ``xxhash``, or zlib's crc32), computed here without
:mod:`.digest`, which imports torch for DCP's file system; a unit test holds the two equal.
"""
from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import PluginError

CHUNK = 4 << 20  # bytes read at a time: large enough for the disk's speed, small enough to never matter
FIX = "-> resume from an earlier step directory (checkpoint inspect DIR lists them)"


class _Hasher:
    """An incremental hash of ``algorithm`` with :class:`.digest.Hasher`'s hexdigest."""

    def __init__(self, algorithm: str):
        self._h, self._crc = None, 0
        if algorithm == "xxh3_64":
            try:
                import xxhash
            except ImportError:
                raise PluginError("the checkpoint's checksums are XXH3-64 and the xxhash package is missing -> "
                                  "pip install xxhash") from None
            self._h = xxhash.xxh3_64()
        elif algorithm != "crc32":
            raise PluginError(f"unknown checksum {algorithm!r} in the manifest -> written by another plugin version")

    def update(self, data) -> None:
        if self._h is not None:
            self._h.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        return self._h.hexdigest() if self._h is not None else f"{self._crc:08x}"


@dataclass
class Report:
    """What :func:`verify` read, and every damaged file or item (``PATH: what is wrong``)."""

    step_dir: Path
    files: int = 0
    items: int = 0
    bytes: int = 0
    seconds: float = 0.0
    algorithms: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)
    unrecorded: list[str] = field(default_factory=list)  # files DCP could have written that the manifest lacks

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _table_problem(items: list, size: int) -> str | None:
    """Why a file's item table is not one run of items from byte 0 to its recorded size, or None."""
    pos = 0
    for off, n, _ in items:
        if off != pos or n <= 0:
            return f"item at byte {off} ({n} bytes) does not follow the previous item, which ends at byte {pos}"
        pos += n
    return None if pos == size else f"the items end at byte {pos}, the recorded size is {size}"


def _verify_file(path: Path, rec: dict, buf: bytearray, report: Report) -> None:
    items = sorted(rec["items"], key=lambda it: it[0])
    table = _table_problem(items, rec["size"])
    if table is not None:
        report.damaged.append(f"{path}: the manifest's item table is inconsistent: {table} (damaged manifest) {FIX}")
    size = path.stat().st_size
    if size != rec["size"]:
        report.damaged.append(f"{path}: {size} bytes, the manifest recorded {rec['size']} (truncated or overwritten) "
                              f"{FIX}")
    algorithm = rec["checksum"]
    if algorithm not in report.algorithms:
        report.algorithms.append(algorithm)
    view = memoryview(buf)
    with open(path, "rb") as f:
        pos = 0
        for k, (off, length, want) in enumerate(items):
            if off + length > size:
                cut = len(items) - k
                report.damaged.append(f"{path}: {cut} item(s) from byte {off} on are cut off: the file ends at byte "
                                      f"{size} (truncated) {FIX}")
                break
            if off != pos:
                f.seek(off)
                pos = off
            h, left = _Hasher(algorithm), length
            while left:
                got = f.readinto(view[: min(left, len(buf))])
                if not got:  # the file shrank while it was read
                    break
                h.update(view[:got])
                left -= got
                pos += got
                report.bytes += got
            report.items += 1
            if left:
                report.damaged.append(f"{path}: item at byte {off} ({length} bytes): the file ends {left} bytes "
                                      f"short of it (truncated) {FIX}")
                break
            if h.hexdigest() != want:
                report.damaged.append(f"{path}: item at byte {off} ({length} bytes): {algorithm} {h.hexdigest()}, "
                                      f"the manifest recorded {want} (corrupted) {FIX}")


def verify(step_dir: str | Path, manifest: dict, chunk: int = CHUNK) -> Report:
    """Every file ``manifest`` records under ``step_dir`` read once, every item checked (see the module docstring).
    Raises :class:`PluginError` only for what is not damage (a checksum this machine cannot compute)."""
    step_dir = Path(step_dir)
    report = Report(step_dir)
    files = manifest.get("files") or {}
    if not files:
        report.damaged.append(f"{step_dir}: the manifest records no files (damaged manifest) {FIX}")
    buf = bytearray(max(1, chunk))
    t0 = time.perf_counter()
    for name, rec in sorted(files.items()):
        path = step_dir / name
        if not path.is_file():
            report.damaged.append(f"{path}: missing {FIX}")
            continue
        if "items" not in rec:
            report.damaged.append(f"{path}: carries no per-item checksums (written by an earlier development version "
                                  "of the plugin's format) -> save it again with this version")
            continue
        report.files += 1
        _verify_file(path, rec, buf, report)
    report.seconds = time.perf_counter() - t0
    report.unrecorded = sorted(p.name for p in step_dir.iterdir()
                               if p.is_file() and p.name not in files and p.suffix == ".distcp")
    return report
