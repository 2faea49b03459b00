"""launch.sh's side of a stop: run the launcher as a child, hand a SIGINT / SIGTERM to the workers, leave no process.

The launchers handle a signal of their own in ways that lose the run or print a traceback: DeepSpeed's runner dies on
SIGINT with a KeyboardInterrupt traceback and passes nothing on (its ``launch.py`` and the workers train on), on SIGTERM
it dies silently; torchrun passes the signal on but then raises torch's ``SignalException`` (a traceback, exit 1)
whatever the workers did, and both it and ``accelerate launch`` print torch's agent's warning lines. So :func:`run`
starts the launcher in a session of its own (a terminal's Ctrl-C then reaches launch.sh alone) and, on SIGINT or
SIGTERM, sends that signal to the workers themselves (:func:`workers`: the topmost processes of the launcher's tree with
``RANK`` in their environment, not their DataLoader workers or compilers), which stop at the next step boundary and save
it (:mod:`.interrupt`), exit, and let their launcher end as after a finished run. A second SIGINT is passed on too (the
workers then stop at once). launch.sh is the child subreaper of the launcher's tree (orphans stay its descendants):
whatever of the tree is still there a second after the workers it stopped have ended (the launcher: nothing left for it
to run), or ``grace_s`` after the first signal, or ``grace_s`` after the launcher has exited, is killed (SIGKILL): no
orphan. launch.sh then exits with 128 + the signal's number. Linux (``/proc``, ``prctl``); elsewhere the signal goes to
the launcher's whole process group instead.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from .interrupt import GRACE_S

POLL_S = 0.5
MARGIN_S = 5.0  # after the workers' own grace: they end themselves first
AFTER_S = 1.0  # once the signalled workers have ended, the time their launcher gets to end on its own


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time) of every process (one pass over ``/proc``)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out[int(entry.name)] = (int(fields[1]), int(fields[19]))
    return out


def tree(root: int) -> dict[int, tuple[int, int]]:
    """``root``'s descendants (not ``root``): pid -> (parent pid, start time)."""
    procs = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in procs and pid not in out:
            out[pid] = procs[pid]
            todo += children.get(pid, [])
    return out


def _has_rank(pid: int) -> bool:
    try:
        return b"\0RANK=" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def workers(procs: dict[int, tuple[int, int]]) -> list[int]:
    """The training processes among ``procs``: those with ``RANK`` in their environment whose parent has none."""
    ranked = {pid for pid in procs if _has_rank(pid)}
    return sorted(pid for pid in ranked if procs[pid][0] not in ranked)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _send(pids, signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _reap() -> None:
    """Collect the exit status of any child that ended (orphans reparented to this subreaper become its children)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _subreaper() -> bool:
    """Become the child subreaper (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``): the launcher's orphans, a dead runner's
    ``launch.py`` and workers, are reparented to this process instead of PID 1, so they stay in its tree."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class _Supervisor:
    def __init__(self, proc: subprocess.Popen, grace_s: float, has_proc: bool):
        self.proc, self.grace_s, self.has_proc = proc, grace_s, has_proc
        self.signum = 0
        self.first = 0.0
        self.signalled: set[int] = set()  # the workers the stop was handed to
        self.ended = 0.0  # when the last of them had ended

    def left(self) -> list[int]:
        return [p for p in tree(os.getpid()) if _alive(p)] if self.has_proc else []

    def on_signal(self, signum, frame) -> None:
        if not self.signum:
            self.signum, self.first = signum, time.monotonic()
        elif signum != signal.SIGINT:
            return  # one stop at a time; only a second SIGINT means "now"
        if self.has_proc:
            found = workers(tree(os.getpid()))
            self.signalled.update(found)
            _send(found, signum)
        else:
            try:
                os.killpg(self.proc.pid, signum)
            except ProcessLookupError:
                pass

    def _workers_ended(self) -> bool:
        """Whether the workers the stop was handed to have all ended, ``AFTER_S`` ago: the launcher, with nothing
        left to run, is then killed (DeepSpeed's ``launch.py`` polls its workers once a second and its runner waits
        for it: seconds under load; a SIGTERM would make torchrun print a traceback)."""
        if not self.signalled or any(_alive(pid) for pid in self.signalled):
            return False
        self.ended = self.ended or time.monotonic()
        return time.monotonic() - self.ended > AFTER_S

    def wait(self) -> int:
        while True:
            try:
                code = self.proc.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            if self.signum and (time.monotonic() - self.first > self.grace_s or self._workers_ended()):
                _send(self.left(), signal.SIGKILL)
        # the launcher has gone: whatever it left (the workers and launch.py of a DeepSpeed runner that died) ends
        # with it, once they had the time to stop at their step boundary (they see their launcher exit: .interrupt)
        deadline = (self.first if self.signum else time.monotonic()) + self.grace_s
        while True:
            _reap()
            left = self.left()
            if not left:
                break
            if time.monotonic() > deadline:
                _send(left, signal.SIGKILL)
            time.sleep(POLL_S)
        return 128 + self.signum if self.signum else code


def run(cmd: list[str], env: dict, *, grace_s: float = GRACE_S + MARGIN_S) -> int:
    """Run the launcher ``cmd`` to its end and return launch.sh's exit status (module docstring)."""
    has_proc = _subreaper() and Path("/proc/self/stat").exists()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    sup = _Supervisor(proc, grace_s, has_proc)
    old = {s: signal.signal(s, sup.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return sup.wait()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
