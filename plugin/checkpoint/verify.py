"""Every byte of a step directory against the checksums its manifest recorded (pure: no torch, no process group,
nothing of the files runs): ``python -m plugin checkpoint verify DIR``.

The manifest records, for every file DCP wrote (each rank's ``.distcp``, and ``.metadata``), its size and the
``[offset, length, digest]`` of each item, taken while the bytes were written (:mod:`.digest`). A load checks the
items a rank reads and stops at the first bad one; :func:`verify` reads every file once, front to back, item by
item through one reused buffer of at most ``chunk`` bytes (memory stays bounded whatever the sizes of files and
items), and returns every damaged file and item at once.

A damaged item is named by its tensor and chunk when ``.metadata`` itself is intact: read then (only then, so an
intact checkpoint is read once) by an unpickler whose classes are stand-ins holding fields (:class:`_Record`), so
nothing of the file runs and torch is not needed.

The hash is :mod:`.checksum`'s, the one :mod:`.digest` takes while DCP writes.
"""
from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path

from .checksum import Hasher

CHUNK = 4 << 20  # bytes read at a time: large enough for the disk's speed, small enough to never matter
FIX = "-> resume from an earlier step directory (checkpoint inspect DIR lists them)"


class _Record:
    """A stand-in for one of DCP's metadata classes: the fields the pickle sets, nothing else."""

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:  # TensorProperties pickles a tuple
            self.state = state


_RECORDS = {name: type(name, (_Record,), {}) for name in (
    "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "BytesStorageMetadata",
    "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING", "_StorageInfo")}
_DCP = {"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"}


class _NamesUnpickler(pickle.Unpickler):
    """The classes :class:`.dcp_io._SafeUnpickler` allows, as :class:`_Record` stand-ins (``torch.Size`` a tuple,
    a dtype its name); any other global is refused."""

    def find_class(self, module, name):
        if module in _DCP and name in _RECORDS:
            return _RECORDS[name]
        if (module, name) == ("torch", "Size"):
            return tuple
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if (module, name) in (("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")):
            return _Record
        if module == "torch":  # torch.float32, torch.strided, ...: a name, never called
            return name
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a checkpoint's .metadata")


def item_names(metadata_path: Path) -> dict[tuple[str, int], str]:
    """``{(file name, offset): "tensor at (chunk offsets)"}`` of every item DCP's ``.metadata`` places, or ``{}``
    when it cannot be read that way."""
    try:
        with open(metadata_path, "rb") as f:
            md = _NamesUnpickler(f).load()
        return {(info.relative_path, info.offset): f"{index.fqn} at {tuple(index.offset)}"
                for index, info in md.storage_data.items()}
    except Exception:  # noqa: BLE001 - names are a courtesy: without them items are named by byte offset
        return {}


class _Names:
    """Item names, read from ``.metadata`` at the first damaged item, and only if ``.metadata`` verified intact."""

    def __init__(self, path: Path):
        self._path, self._table, self.intact = path, None, False

    def __call__(self, name: str, offset: int) -> str:
        if not self.intact:
            return ""
        if self._table is None:
            self._table = item_names(self._path)
        found = self._table.get((name, offset))
        return f", {found}" if found else ""


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


def _verify_file(path: Path, rec: dict, buf: bytearray, report: Report, names: _Names) -> None:
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
                cut = [names(path.name, o)[2:] for o, _, _ in items[k:]]
                shown = "; ".join(c for c in cut[:3] if c) + ("; ..." if len(cut) > 3 and cut[0] else "")
                report.damaged.append(f"{path}: {len(cut)} item(s) from byte {off} on are cut off"
                                      f"{f' ({shown})' if shown else ''}: the file ends at byte {size} (truncated) "
                                      f"{FIX}")
                break
            if off != pos:
                f.seek(off)
                pos = off
            h, left = Hasher(algorithm), length
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
                report.damaged.append(f"{path}: item at byte {off} ({length} bytes{names(path.name, off)}): the "
                                      f"file ends {left} bytes short of it (truncated) {FIX}")
                break
            if h.hexdigest() != want:
                report.damaged.append(f"{path}: item at byte {off} ({length} bytes{names(path.name, off)}): "
                                      f"{algorithm} {h.hexdigest()}, the manifest recorded {want} (corrupted) {FIX}")


def verify(step_dir: str | Path, manifest: dict, chunk: int = CHUNK) -> Report:
    """Every file ``manifest`` records under ``step_dir`` read once, every item checked (see the module docstring).
    Raises :class:`PluginError` only for what is not damage (a checksum this machine cannot compute)."""
    step_dir = Path(step_dir)
    report = Report(step_dir)
    files = manifest.get("files") or {}
    if not files:
        report.damaged.append(f"{step_dir}: the manifest records no files (damaged manifest) {FIX}")
    buf = bytearray(max(1, chunk))
    names = _Names(step_dir / ".metadata")
    t0 = time.perf_counter()
    for name, rec in sorted(files.items(), key=lambda kv: (kv[0] != ".metadata", kv[0])):  # .metadata names items
        path = step_dir / name
        if not path.is_file():
            report.damaged.append(f"{path}: missing {FIX}")
            continue
        if "items" not in rec:
            report.damaged.append(f"{path}: carries no per-item checksums (written by an earlier development version "
                                  "of the plugin's format) -> save it again with this version")
            continue
        report.files += 1
        before = len(report.damaged)
        _verify_file(path, rec, buf, report, names)
        if name == ".metadata":
            names.intact = len(report.damaged) == before
    report.seconds = time.perf_counter() - t0
    report.unrecorded = sorted(p.name for p in step_dir.iterdir()
                               if p.is_file() and p.name not in files and p.suffix == ".distcp")
    return report
