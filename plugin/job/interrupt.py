"""A stop asked by a signal, honoured at a step boundary: SIGINT (Ctrl-C), SIGTERM (a scheduler's preemption, a
launcher shutting its workers down), or the exit of the launcher that started this process.

:class:`Interrupts` has two phases. From :meth:`~Interrupts.install` (the first thing a training script does) until
:meth:`~Interrupts.training`, nothing is worth saving: a signal ends the process at once, without a traceback (a
quiet ``SystemExit`` in the main thread, so ``finally`` blocks run; from outside after 3 s if the main thread is stuck
in a C++ call, e.g. a rendezvous waiting for peers that never come). From
then on the first signal is a request (:attr:`~Interrupts.requested`): the engine tells every rank whether any rank
has one after each step (``engine.last_step.stop_requested``, carried by the step report's all-reduce, so every rank
stops after the same step, and only when every rank reached it), and the loop saves that step and ends. Meanwhile a
grace timer runs (``grace_s``, 25 s by default: shorter than the 30 s torchrun and DeepSpeed's launcher wait between
their SIGTERM and SIGKILL): a process still running when it ends (a step or a save that did not finish, a peer that
is gone) ends at once, without its checkpoint. A second SIGINT, at least ``echo_s`` after the first, ends it at once;
a later SIGTERM does not (torchrun sends one to the other workers as soon as one fails, and passes a second Ctrl-C on
as SIGTERM): the step is still saved.

The signals are read from Python's wakeup fd (``signal.set_wakeup_fd``) by a thread, so the request, the second
SIGINT and the grace's end act at once even while the main thread waits inside a collective or a C++ kernel; the
Python-level handlers only keep the default actions (KeyboardInterrupt, termination) away.

The launcher's exit: DeepSpeed's runner dies on a SIGINT without passing it on (its ``launch.py`` and the workers train
on), and a launcher killed outright leaves its workers behind. So each process watches its Python ancestors up to the
first that is not Python (the shell, a scheduler's step daemon): the launcher chain (DeepSpeed's runner and its
``launch.py``, torchrun, ``accelerate launch``, launch.sh's Python). When one of them exits, that is a request to stop,
as a SIGTERM is. Linux only (``/proc``); elsewhere nothing is watched.

Pure (no torch): the collective is the engine's.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

GRACE_S = 25.0
ECHO_S = 1.0
WATCH_S = 0.5  # how often the launcher chain is looked at
STUCK_S = 3.0  # during start-up, a main thread that has not ended this long after a signal is ended from outside


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time in clock ticks) from ``/proc/PID/stat``, or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the command name, in parentheses, may hold spaces
    return fields[0], int(fields[1]), int(fields[19])


def launcher_chain(pid: int | None = None) -> list[tuple[int, int]]:
    """``(pid, start time)`` of the Python processes above ``pid`` (this process), nearest first, up to the first
    ancestor that is not a Python interpreter. Empty where ``/proc`` is missing."""
    chain = []
    here = _stat(os.getpid() if pid is None else pid)
    parent = here[1] if here else 0
    while parent > 1:
        try:
            exe = os.path.basename(os.readlink(f"/proc/{parent}/exe"))
        except OSError:
            break
        st = _stat(parent)
        if st is None or not exe.startswith("python"):
            break
        chain.append((parent, st[2]))
        parent = st[1]
    return chain


def gone(chain: list[tuple[int, int]]) -> int | None:
    """The first pid of ``chain`` that has exited (or is a zombie, or is another process by now), else None."""
    for pid, started in chain:
        st = _stat(pid)
        if st is None or st[0] in ("Z", "X") or st[2] != started:
            return pid
    return None


class Interrupts:
    """SIGINT / SIGTERM / the launcher's exit as a request to stop at the next step boundary (module docstring).

    ``say``: prints a line (train.py: rank 0's stderr; None on the other ranks) for what this process does on its
    own (the grace's end, a second SIGINT). ``launched``: started by a launcher (torchrun, deepspeed, accelerate,
    launch.sh), whose own report on a worker's non-zero exit would be noise after a clean stop: such a process ends
    with 0 (:meth:`exit_code`), a lone process with 128 + the signal's number, as a shell expects. ``on_exit``:
    called before the process ends at once (release the ``--save`` lock)."""

    def __init__(self, *, grace_s: float = GRACE_S, echo_s: float = ECHO_S, say: Callable[[str], None] | None = None,
                 launched: bool = False, watch_launcher: bool = True):
        self.grace_s, self.echo_s, self.say, self.launched = grace_s, echo_s, say, launched
        self.watch_launcher = watch_launcher
        self.on_exit: list[Callable[[], None]] = []
        self.requested: str | None = None  # "SIGINT", "SIGTERM" or "the launcher (pid N) exited"
        self.signum = 0  # the request's signal (SIGTERM for the launcher's exit)
        self._first = 0.0
        self._phase = "start-up"
        self._lock = threading.Lock()
        self._grace: threading.Timer | None = None
        self._installed = False

    # ------------------------------------------------------------------ setting up
    def install(self) -> Interrupts:
        """Take over SIGINT and SIGTERM (main thread only) and start watching the launcher chain."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._write_fd, self._installed = write_fd, True
        self._old_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._old_handlers = {s: signal.signal(s, self._handler) for s in (signal.SIGINT, signal.SIGTERM)}
        threading.Thread(target=self._read, args=(read_fd,), name="plugin-signals", daemon=True).start()
        if self.watch_launcher:
            chain = launcher_chain()
            if chain:
                threading.Thread(target=self._watch, args=(chain,), name="plugin-launcher-watch", daemon=True).start()
        return self

    def uninstall(self) -> None:
        """Give SIGINT, SIGTERM and the wakeup fd back as they were, and end the threads (a process that goes on after
        train.py's main, as a test calling it does, must not keep a handler that could end it later)."""
        if not self._installed:
            return
        self._installed = False
        signal.set_wakeup_fd(self._old_wakeup)
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        self.done()
        os.write(self._write_fd, b"\0")  # the reader's sign to end
        os.close(self._write_fd)

    def training(self) -> None:
        """From now on a signal asks for a stop at the next step boundary (a request that came during start-up has
        already ended the process)."""
        self._phase = "training"

    def is_requested(self) -> bool:
        """This process's request (``engine.stop_request``)."""
        return self.requested is not None

    def exit_code(self) -> int:
        """The exit status after a clean stop: 0 under a launcher, else 128 + the signal's number."""
        return 0 if self.launched or not self.signum else 128 + self.signum

    def done(self) -> None:
        """The stop is complete (saved, or nothing to save): the grace timer no longer applies."""
        with self._lock:
            if self._grace is not None:
                self._grace.cancel()

    # ------------------------------------------------------------------ what happens
    def _handler(self, signum, frame) -> None:
        """The Python-level handler (main thread): during start-up a quiet SystemExit, so ``finally`` blocks run (a
        JIT build's lock file is released, the ``--save`` lock too); once training, nothing (the reader thread acts
        on the wakeup fd's byte)."""
        if self._phase == "start-up":
            raise SystemExit(128 + signum)

    def _read(self, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, 64)
            except OSError:
                return
            if not data or 0 in data:  # uninstall
                os.close(fd)
                return
            for signum in data:  # the wakeup fd has a byte for every signal with a Python handler: only ours count
                if signum in (signal.SIGINT, signal.SIGTERM):
                    self._on(signum, signal.Signals(signum).name)

    def _watch(self, chain: list[tuple[int, int]]) -> None:
        while self.requested is None and self._installed:
            pid = gone(chain)
            if pid is not None:
                self._on(int(signal.SIGTERM), f"the launcher (pid {pid}) exited")
                return
            time.sleep(WATCH_S)

    def _on(self, signum: int, what: str) -> None:
        with self._lock:
            now = time.monotonic()
            if self._phase == "start-up":  # nothing trained yet: nothing to save, nothing to say
                if self._grace is None:  # the main thread's SystemExit (_handler) ends it; this, if it is stuck
                    self._grace = threading.Timer(STUCK_S, self._end_now, (128 + signum, None))
                    self._grace.daemon = True
                    self._grace.start()
                return
            if self.requested is None:
                self.requested, self.signum, self._first = what, signum, now
                self._grace = threading.Timer(self.grace_s, self._grace_over)
                self._grace.daemon = True
                self._grace.start()
            elif signum == signal.SIGINT and now - self._first >= self.echo_s:
                self._end_now(128 + signum, "second interrupt: stopped at once, without saving")

    def _grace_over(self) -> None:
        self._end_now(128 + self.signum, f"stopped {self.grace_s:g} s after {self.requested} (the grace period) "
                                         "before the step's checkpoint was complete: stopped without it")

    def _end_now(self, code: int, line: str | None) -> None:
        """End the process from whichever thread, at once (os._exit: the main thread may be inside a collective)."""
        for release in self.on_exit:
            try:
                release()
            except Exception:  # ending anyway
                pass
        if line and self.say is not None:
            self.say(line)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed stream
                pass
        os._exit(code)


