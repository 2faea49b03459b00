"""One process's part of a training job, from the script's first line to its last (pure: no torch).

:class:`Job` is the context manager train.py opens before anything else: it installs the signal handling
(:mod:`.interrupt`: a Ctrl-C during start-up ends quietly, once training a signal stops at the next step boundary),
claims the ``--save`` directory (:mod:`.lock`: rank 0 takes the lock, every rank asks whether the directory may be
trained into), and gives both back however the script ends. Which rank this process is comes from the launcher's
``RANK`` (no process group exists yet); :meth:`Job.say` prints on rank 0 only, :meth:`Job.refuse` ends a start that
cannot train as argparse ends a bad flag: a message, exit 2, no traceback.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from .interrupt import GRACE_S, Interrupts
from .lock import JobLockedError, SaveLock, run_id, used_refusal


def say_line(line: str) -> None:
    """One line on stderr, flushed (every rank's own, e.g. the elastic sit-out line)."""
    print(line, file=sys.stderr, flush=True)


class Job:
    """This process's job: ``rank0``, the ``interrupts`` and, with ``save``, the directory's lock (module docstring).

    ``resume``: the script resumes (``--resume``), so a ``save`` directory holding another run's checkpoints is
    its own run's and may be trained into."""

    def __init__(self, save: str | None = None, *, resume: str | None = None, grace_s: float = GRACE_S,
                 environ: Mapping[str, str] = os.environ):
        self.save, self.resume = save, resume
        self.rank0 = environ.get("RANK", "0") == "0"  # before any process group: the launcher's word
        self.interrupts = Interrupts(grace_s=grace_s, launched="RANK" in environ,
                                     say=say_line if self.rank0 else None)
        self.lock: SaveLock | None = None

    def __enter__(self) -> Job:
        self.interrupts.install()
        self.interrupts.on_exit.append(self.release)  # a stop at once (grace over, second Ctrl-C) frees --save too
        try:
            self._claim()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.release()
        self.interrupts.uninstall()

    def _claim(self) -> None:
        """One job per ``--save`` directory: rank 0 takes its lock; every rank refuses a fresh run into a directory
        holding another run's checkpoints (its first save would drop them), rank 0 saying why."""
        if not self.save:
            return
        if self.rank0:
            try:
                self.lock = SaveLock(self.save, run_id()).acquire()
            except JobLockedError as e:
                self.refuse(str(e))
        refused = used_refusal(self.save, resume=bool(self.resume))
        if refused:
            self.refuse(refused, everyone=False)

    def release(self) -> None:
        """Give the ``--save`` lock back (idempotent)."""
        if self.lock is not None:
            self.lock.release()

    def training(self, engine) -> None:
        """From the first step on, a signal asks for a stop at the next step boundary; the engine tells every rank
        after each step whether any rank has one (``engine.last_step.stop_requested``)."""
        engine.stop_request = self.interrupts.is_requested
        self.interrupts.training()

    def stopped(self) -> int:
        """The exit status once a stop is complete (saved, or nothing to save): the grace timer no longer applies."""
        self.interrupts.done()
        return self.interrupts.exit_code()

    def say(self, line: str) -> None:
        """Print ``line`` on rank 0's stderr (nothing on the other ranks)."""
        if self.rank0:
            say_line(line)

    def refuse(self, text: str, *, everyone: bool = True) -> None:
        """End this start before its first step: ``text`` on stderr (every rank's, or rank 0's alone where every
        rank reached the same verdict), then exit 2 (``SystemExit``, as argparse's error: ``finally`` blocks run)."""
        if everyone or self.rank0:
            print(text, file=sys.stderr)
        raise SystemExit(2)
