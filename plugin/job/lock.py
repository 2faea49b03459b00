"""One job per ``--save`` directory: a lock file in it, taken before any process group exists.

The lock (``DIR/plugin-job.lock``, JSON) names its holder: host, pid, run id, when it started, and a timestamp the
holder refreshes every :data:`REFRESH_S` seconds while it lives. A lock is stale, and is taken over, when its holder
is gone: on this host its pid is not running (seen at once), on another host its timestamp is older than
:data:`STALE_S` (the holder stopped refreshing). A lock of the same run id is taken over too: a restart of the same
run (torchrun's rendezvous id is the same for every restart of one elastic job) continues its own directory.
Anything else is refused with :class:`JobLockedError`, naming the running job.

Pure (no torch): ``launch.sh`` asks :func:`live_holder` before it starts any launcher, and train.py's rank 0 takes
the lock (:meth:`SaveLock.acquire`) before ``plugin.initialize``. The API for elastic restarts: :func:`run_id`, the
:class:`SaveLock` context manager, :func:`read_holder`, :func:`is_stale`.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from ..checkpoint.directory import complete_steps
from ..errors import PluginError

LOCK_NAME = "plugin-job.lock"
REFRESH_S = 5.0  # the holder rewrites its timestamp this often
STALE_S = 30.0  # a holder on another host that has not refreshed for this long is taken as gone


class JobLockedError(PluginError):
    """Another live job holds the directory's lock."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: what the lock file says."""

    host: str
    pid: int
    run_id: str
    started: float  # time.time() when it was taken
    refreshed: float  # time.time() of its last refresh

    def describe(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        ago = max(0.0, now - self.refreshed)
        return f"run {self.run_id} (pid {self.pid} on {self.host}, started {started}, alive {ago:.0f} s ago)"


def run_id(env=None) -> str:
    """This job's run id, the same on every rank of one launch: torchrun's rendezvous id ``TORCHELASTIC_RUN_ID`` where
    there is one (``accelerate launch`` sets it to ``none``: no id), else ``PLUGIN_RUN_ID`` (``launch.sh`` makes one per
    launch), else a new one (a job started without either: only rank 0 needs it, as only rank 0 takes the lock)."""
    env = os.environ if env is None else env
    for name in ("TORCHELASTIC_RUN_ID", "PLUGIN_RUN_ID"):
        value = env.get(name, "").strip()
        if value and value.lower() != "none":
            return value
    return uuid.uuid4().hex[:12]


def new_run_id() -> str:
    """A run id for ``PLUGIN_RUN_ID``: what launch.sh exports for the launch it starts."""
    return uuid.uuid4().hex[:12]


def lock_path(directory) -> Path:
    return Path(directory) / LOCK_NAME


def read_holder(directory) -> Holder | None:
    """The lock's holder, or None when there is no lock (a lock being written, or unreadable, reads as None only
    if it vanished: a file that is not a lock's JSON is a holder of unknown pid, never stale by pid)."""
    path = lock_path(directory)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        return Holder(host=str(data["host"]), pid=int(data["pid"]), run_id=str(data["run_id"]),
                      started=float(data["started"]), refreshed=float(data["refreshed"]))
    except (ValueError, KeyError, TypeError):  # half-written by a holder that died mid-write: its mtime decides
        mtime = path.stat().st_mtime
        return Holder(host="?", pid=0, run_id="?", started=mtime, refreshed=mtime)


def _pid_running(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    try:  # a zombie (exited, not yet reaped) is gone too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def is_stale(holder: Holder, *, now: float | None = None, host: str | None = None, stale_s: float = STALE_S) -> bool:
    """Whether ``holder`` is gone: on this host its pid is not running; anywhere, its timestamp is older than
    ``stale_s`` (a holder that stopped refreshing: dead on another host, or hung)."""
    now = time.time() if now is None else now
    host = socket.gethostname() if host is None else host
    if holder.host == host and holder.pid and not _pid_running(holder.pid):
        return True
    return now - holder.refreshed > stale_s


def live_holder(directory, run: str | None = None, *, stale_s: float = STALE_S) -> Holder | None:
    """The live holder of another run (not ``run``) of ``directory``'s lock, or None: what a new job would be
    refused for. Reads only (launch.sh's check before it starts a launcher)."""
    holder = read_holder(directory)
    if holder is None or holder.run_id == run or is_stale(holder, stale_s=stale_s):
        return None
    return holder


def refusal(directory, holder: Holder) -> str:
    return (f"--save {directory}: another job is training into this directory: {holder.describe()} -> wait for it "
            "to end, or stop it (Ctrl-C: it saves its step), or give another --save directory")


def used_refusal(directory, *, resume: bool) -> str | None:
    """Why a fresh run (no ``--resume``) may not save into ``directory``: it holds the complete checkpoints of another
    run, which the fresh run's first save would drop (a save of step s removes the steps >= s: one timeline per
    directory). None when it may."""
    held = [] if resume else complete_steps(Path(directory))
    if not held:
        return None
    return (f"--save {directory}: holds the complete checkpoints of another run (steps "
            f"{', '.join(str(step) for step, _ in held)}); a fresh run's saves would replace them -> --resume "
            f"{directory} to continue that run, or give another --save directory")


def save_refusal(directory, *, resume: bool) -> str | None:
    """Why a new job may not train into ``directory`` (``--save``), or None: another live job holds its lock
    (:func:`refusal`), or :func:`used_refusal`. launch.sh asks before it starts a launcher; train.py's rank 0 takes
    the lock instead, every rank asks :func:`used_refusal`."""
    holder = live_holder(directory)
    return refusal(directory, holder) if holder is not None else used_refusal(directory, resume=resume)


class SaveLock:
    """The lock of one ``--save`` directory, held by this process from :meth:`acquire` to :meth:`release` (also a
    context manager), its timestamp refreshed by a daemon thread every ``refresh_s`` seconds."""

    def __init__(self, directory, run: str, *, refresh_s: float = REFRESH_S, stale_s: float = STALE_S):
        self.directory, self.run_id = Path(directory), run
        self.refresh_s, self.stale_s = refresh_s, stale_s
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.took_over: Holder | None = None  # the stale (or same-run) holder this acquire replaced
        self._started = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def path(self) -> Path:
        return lock_path(self.directory)

    def _text(self) -> str:
        now = time.time()
        return json.dumps(asdict(Holder(self.host, self.pid, self.run_id, self._started, now)))

    def _write_over(self) -> None:
        """Replace the lock file atomically (a reader never sees half of it)."""
        tmp = self.path.with_name(f"{LOCK_NAME}.{self.pid}.tmp")
        tmp.write_text(self._text(), encoding="utf-8")
        os.replace(tmp, self.path)

    def acquire(self) -> SaveLock:
        """Take the lock, or raise :class:`JobLockedError` naming the live job that holds it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._started = time.time()
        for _ in range(3):  # a race with another taker: read again and decide again
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = read_holder(self.directory)
                if holder is None:
                    continue
                if holder.run_id != self.run_id and not is_stale(holder, stale_s=self.stale_s):
                    raise JobLockedError(refusal(self.directory, holder)) from None
                self.took_over = holder
                gone = self.path.with_name(f"{LOCK_NAME}.{self.pid}.old")
                try:
                    os.replace(self.path, gone)  # only one taker gets it; the others read the new holder
                except FileNotFoundError:
                    continue
                gone.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self._text())
            self._thread = threading.Thread(target=self._refresh, name="plugin-save-lock", daemon=True)
            self._thread.start()
            return self
        raise JobLockedError(f"--save {self.directory}: could not take {self.path} (other jobs keep taking it) -> "
                             "give another --save directory")

    def _refresh(self) -> None:
        while not self._stop.wait(self.refresh_s):
            holder = read_holder(self.directory)
            if holder is None or holder.pid != self.pid or holder.run_id != self.run_id:
                return  # taken over (a restart of this run): not ours any more
            try:
                self._write_over()
            except OSError:
                pass  # a full or vanished disk: the next refresh tries again

    def release(self) -> None:
        """Stop refreshing and remove the lock if it is still this process's (idempotent)."""
        self._stop.set()
        holder = read_holder(self.directory)
        if holder is not None and holder.pid == self.pid and holder.run_id == self.run_id and holder.host == self.host:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> SaveLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
