"""The directory protocol (pure: no torch). ``DIR/step-00000004/`` is one complete checkpoint; a save in progress
(or one a crash interrupted) is ``DIR/step-00000004.partial/``, renamed once every rank has written and the
manifest is in place; ``DIR/latest`` names the last complete step (a hint for people and tools: a resume takes the
highest complete step, whatever ``latest`` says, so a crash between the rename and ``latest`` loses nothing).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import threading
import uuid
from pathlib import Path

from ..errors import PluginError

MANIFEST = "plugin-checkpoint.json"
LATEST = "latest"
_STEP = re.compile(r"^step-(\d{8,})$")
_DROPPED = ".dropped-"
_deleting: list[threading.Thread] = []  # the background deletions of this process (:func:`_remove`)


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def write_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` through ``path.tmp`` + fsync + rename: a reader sees the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_complete(step_dir: Path) -> bool:
    """A step directory whose manifest says complete and whose DCP metadata exists."""
    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return bool(manifest.get("complete")) and (step_dir / ".metadata").exists()


def complete_steps(root: Path) -> list[tuple[int, Path]]:
    """``[(step, directory)]`` of the complete checkpoints under ``root``, oldest first."""
    out = []
    if root.is_dir():
        for d in root.iterdir():
            m = _STEP.match(d.name)
            if m and d.is_dir() and is_complete(d):
                out.append((int(m.group(1)), d))
    return sorted(out)


def resolve(directory: str | Path) -> Path:
    """The step directory to read: ``directory`` itself when it holds a manifest, else the highest complete step
    under it. Raises :class:`PluginError` listing what was found when there is none."""
    root = Path(directory)
    if root.is_file():
        raise PluginError(f"{root}: a file, not a checkpoint directory -> give the directory passed to --save")
    if (root / MANIFEST).exists():
        if not is_complete(root):
            raise PluginError(f"{root}: the checkpoint is incomplete (its manifest does not say complete, or "
                              ".metadata is missing) -> resume from another step directory")
        return root
    steps = complete_steps(root)
    if steps:
        return steps[-1][1]
    if not root.exists():
        raise PluginError(f"{root}: no such checkpoint directory -> give the directory passed to --save")
    found = sorted(p.name for p in root.iterdir())
    old = [n for n in ("native.json", "latest_step") if n in found] or (
        ["latest"] if "latest" in found and not any(_STEP.match(n) for n in found) else [])
    why = (f"written by an older plugin or by DeepSpeed itself ({', '.join(old)}); not readable" if old else
           "found " + (", ".join(f"{n} (incomplete: no manifest)" if n.endswith(".partial") else n for n in found)
                       or "nothing"))
    raise PluginError(f"{root}: no complete checkpoint: {why} -> resume from a directory written by --save")


def _remove(step_dir: Path) -> None:
    """Out of sight at once, deleted in the background: a rename to ``step-N.dropped-<id>`` (no longer a step, so
    nothing resumes from it or counts it), then a thread deletes it. Deleting a checkpoint's files takes as long as
    writing part of a new one (the kernel frees every page and block); the save need not wait for it. The thread is
    not a daemon, so the interpreter finishes it before it exits; what a crash leaves is deleted by the next save's
    :func:`prune`."""
    gone = step_dir.with_name(f"{step_dir.name}{_DROPPED}{uuid.uuid4().hex[:8]}")
    try:
        os.rename(step_dir, gone)
    except OSError:
        return
    t = threading.Thread(target=shutil.rmtree, args=(gone,), kwargs={"ignore_errors": True}, name=gone.name)
    _deleting.append(t)
    t.start()


def settle() -> None:
    """Wait until every checkpoint this process dropped is deleted (tests that list a directory call it)."""
    while _deleting:
        _deleting.pop().join()


def drop_later_steps(root: Path, step: int) -> list[str]:
    """Before step ``step`` is committed: remove every checkpoint of a step ``>= step`` under ``root``.

    A directory holds one timeline. A run that saves step ``s`` is at step ``s`` (it started there or resumed from
    an earlier step), so a checkpoint of a higher step is from a timeline it abandoned (a run that went further,
    then was resumed from an older step): left there, it would be what the next ``--resume`` takes (the highest
    complete step) and what ``--keep`` counts as newest. Removed before the rename, a crash in between leaves the
    step the run resumed from as the highest, never the abandoned one. Returns the names removed."""
    gone = []
    if root.is_dir():
        for d in sorted(root.iterdir()):
            m = _STEP.match(d.name)
            if m and d.is_dir() and int(m.group(1)) >= step:
                _remove(d)
                gone.append(d.name)
    return gone


def prune(root: Path, keep: int | None, just_written: Path) -> None:
    """Delete every ``*.partial`` directory (saves are synchronous: none is in progress) and, with ``keep``, the
    oldest complete steps beyond the ``keep`` newest, never ``just_written`` (renamed out of sight, then deleted in
    the background: :func:`_remove`); and what a crash left of earlier background deletions."""
    for d in root.iterdir():
        if d.is_dir() and d.name.endswith(".partial") and _STEP.match(d.name[: -len(".partial")]):
            shutil.rmtree(d, ignore_errors=True)
        elif (d.is_dir() and _DROPPED in d.name and _STEP.match(d.name.split(_DROPPED)[0])
              and not any(t.name == d.name and t.is_alive() for t in _deleting)):  # a crash's leftovers
            shutil.rmtree(d, ignore_errors=True)
    if keep is None:
        return
    steps = [d for _, d in complete_steps(root)]
    for d in steps[: max(0, len(steps) - keep)]:
        if d.resolve() != just_written.resolve():
            _remove(d)
