"""Saving and loading a :class:`~.boxes.LocalState`: the directory protocol over DCP (every rank calls them).

Save: rank 0 makes ``DIR/step-N.partial``; every rank writes its pieces through DCP (``sync_files``: data and
``.metadata`` fsynced; written behind, :mod:`.writeback`, so the fsync finds little left and the files leave the
page cache), each item's checksum taken while it is written (:mod:`.digest`); rank 0 gathers those,
writes the manifest (tensor table, sizes, checksums) atomically, removes the steps above N (an abandoned timeline:
see :func:`~.directory.drop_later_steps`), renames the directory to ``step-N``, replaces ``DIR/latest`` and prunes.
Load: the manifest, then every check that needs no collective (model names and shapes, files and sizes), then
DCP's resharding read into the pieces, every item's bytes checked against its checksum as they are read.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from .boxes import LocalState
from .checksum import default_algorithm
from .dcp_io import ROW_MAJOR, CheckpointError, PieceLoadPlanner, PieceSavePlanner, SafeReader
from .digest import SummingFileSystem, file_record
from .directory import LATEST, MANIFEST, drop_later_steps, fsync_dir, prune, resolve, step_name, write_atomic
from .manifest import FORMAT, VERSION, check_files, read_manifest


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _gather(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


@contextmanager
def _no_zip_crc32():
    """``torch.save`` without the zip's CRC-32 of every record while DCP writes the items: each item already gets
    an XXH3 checksum over all its bytes (:mod:`.digest`), checked on every read, and the CRC-32 (computed by
    torch at 3.8 GB/s here, 0.18 s per 0.7 GB) is never checked by ``torch.load``. torch's option is
    process-wide: restored when the save ends."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def role_of(name: str) -> str:
    return "optim" if name.startswith("optim.") else "rng" if name.startswith("rng/") else "param"


def save(state: LocalState, directory: str | Path, step: int, info: dict, *, keep: int | None = None) -> Path:
    """Write ``state`` as ``directory/step-{step}`` (crash-safe); ``info``: the manifest's JSON fields (layout,
    recipe, model, ...). Returns the step directory."""
    root = Path(directory)
    final = root / step_name(step)
    tmp = root / (final.name + ".partial")
    try:
        json.dumps(state.scalars)
    except TypeError as e:
        raise CheckpointError(f"the checkpoint's scalars and client_state must be JSON ({e}) -> pass plain numbers, "
                              "strings, lists and dicts") from None
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    t0 = time.perf_counter()
    writer = FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1)
    algorithm = default_algorithm()
    writer.fs = fs = SummingFileSystem(algorithm)
    try:
        with _no_zip_crc32():
            metadata = dcp.save(state.entries, storage_writer=writer, planner=PieceSavePlanner())
    except CheckpointException as e:  # a BaseException: `except Exception` would miss it
        raise CheckpointError(f"{tmp}: saving failed: {e}") from None
    mine = {n: file_record(tmp, n, items, algorithm) for n, items in fs.items.items() if n.endswith(".distcp")}
    files = {k: v for d in _gather(mine) for k, v in d.items()}
    if _rank() == 0:
        files[".metadata"] = file_record(tmp, ".metadata", fs.items[".metadata"], algorithm)
        tensors = {}
        for name, md in sorted(metadata.state_dict_metadata.items()):
            rec = {"role": role_of(name), "shape": list(md.size), "dtype": str(md.properties.dtype).split(".")[-1]}
            if rec["role"] == "optim":
                rec["param"], rec["key"] = name[len("optim."):].rsplit(".", 1)
            tensors[name] = rec
        manifest = {"format": FORMAT, "version": VERSION, "complete": True, "step": step, "item_format": ROW_MAJOR,
                    **info,
                    "scalars": state.scalars, "tensors": tensors, "files": files,
                    "save_seconds": round(time.perf_counter() - t0, 3)}
        write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1) + "\n")
        fsync_dir(tmp)
        drop_later_steps(root, step)  # and the same step saved again: the new one replaces it
        os.rename(tmp, final)
        fsync_dir(root)
        write_atomic(root / LATEST, final.name + "\n")
        fsync_dir(root)
        prune(root, keep, final)
    _barrier()
    return final


def open_checkpoint(directory: str | Path) -> tuple[Path, dict]:
    """The step directory ``directory`` resolves to, and its manifest, its files checked for presence and size."""
    step_dir = resolve(directory)
    manifest = read_manifest(step_dir)
    bad = check_files(step_dir, manifest)
    old = sorted(n for n, rec in manifest.get("files", {}).items() if "items" not in rec)
    if old:
        raise CheckpointError(f"{step_dir}: {', '.join(old)} carry no per-item checksums (written by an earlier "
                              "development version of the plugin's format) -> save it again with this version")
    if bad:
        raise CheckpointError("the checkpoint is damaged:\n  " + "\n  ".join(bad)
                              + "\n-> resume from an earlier step directory")
    return step_dir, manifest


def load(state: LocalState, step_dir: Path, manifest: dict) -> None:
    """Fill ``state``'s pieces from ``step_dir`` (resharding on read), then run its ``after_load`` callables."""
    reader = SafeReader(step_dir, manifest["files"], manifest.get("item_format") == ROW_MAJOR)
    try:
        dcp.load(state.entries, storage_reader=reader, planner=PieceLoadPlanner())
    except CheckpointException as e:  # a BaseException; its failures carry our CheckpointError messages
        failures = getattr(e, "failures", {}) or {}
        first = next(iter(failures.values()), e)
        raise CheckpointError(str(getattr(first, "args", [first])[0] if isinstance(first, Exception) else first)) \
            from None
    with torch.no_grad():
        for fn in state.after_load:
            fn()
