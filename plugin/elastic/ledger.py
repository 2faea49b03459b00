"""The run's ledger in its save directory (pure: no torch): what the last trained step was, when, on what layout,
and how many times the run has started.

Rank 0 rewrites ``DIR/elastic-run.json`` after every step it trains. A restarted run reads it before training
again: its ``start`` counts every (re)start of the run, which ``TORCHELASTIC_RESTART_COUNT`` does not (each agent
keeps its own count, a node that joins later starts from 0, and a membership change does not count), and its
``time`` is the last moment the job was known to train. The time from there to the next trained step is the
recovery: ``resumed at step N after S s, data D -> D'``. It starts at the last heartbeat, which the node's loss
follows by at most one step, so S overstates the time from the loss itself by at most one step time. ``time`` is
the wall clock of whichever node held rank 0: across nodes, S is as good as their clocks agree.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

LEDGER = "elastic-run.json"


@dataclass(frozen=True)
class Ledger:
    run: str  # TORCHELASTIC_RUN_ID ("" outside torchrun)
    start: int  # 0 at the run's first start, one more at every restart
    step: int  # the last step trained (0: none yet)
    time: float  # when it finished (time.time() of rank 0)
    data: int  # the data degree it trained at
    processes: int  # the processes that trained it


def read_ledger(directory: str | Path) -> Ledger | None:
    """The ledger in ``directory``, or None when there is none (or it cannot be read: a fresh start)."""
    try:
        return Ledger(**json.loads((Path(directory) / LEDGER).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def write_ledger(directory: str | Path, ledger: Ledger) -> None:
    """Replace the ledger at once (rename), so a reader sees the old one or the new one. Not fsynced: it is a
    heartbeat, rewritten every step; after a power loss the checkpoints, which are fsynced, still say where to go."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{LEDGER}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(asdict(ledger)))
    os.replace(tmp, root / LEDGER)


def this_start(previous: Ledger | None) -> int:
    """The start number of this process's run: 0 without a ledger, else one more than the last start's."""
    return 0 if previous is None else previous.start + 1


def recovery_line(previous: Ledger | None, step: int, now: float, data: int) -> str | None:
    """``resumed at step N after S s, data D -> D'`` for the first step a restarted run trained, or None when there
    was no trained step before (a first start, or a restart before any step)."""
    if previous is None or previous.step == 0:
        return None
    return (f"resumed at step {step} after {now - previous.time:.1f} s, data {previous.data} -> {data} "
            f"(start {previous.start + 1}; the last step trained before was {previous.step})")


class Heartbeat:
    """The ledger as a run keeps it: read by every rank before any process group exists (so that every rank knows
    this start's number before rank 0 rewrites it), written by rank 0 at the start and after every trained step."""

    def __init__(self, directory: str | Path, run: str):
        self.directory, self.run = Path(directory), run
        self.previous = read_ledger(directory)
        self.start = this_start(self.previous)
        self.writes = False
        self._first = True

    def begin(self, main: bool, data: int, processes: int) -> None:
        """At this start, once every rank has read the ledger (after the process group exists): count the start."""
        self.writes, self.data, self.processes = main, data, processes
        if main:
            p = self.previous
            write_ledger(self.directory, Ledger(self.run, self.start, p.step if p else 0, p.time if p else 0.0,
                                                p.data if p else data, p.processes if p else processes))

    def beat(self, step: int, now: float) -> str | None:
        """After training ``step``: rank 0 records it; on this start's first step, the recovery line (or None)."""
        line = recovery_line(self.previous, step, now, self.data) if self._first else None
        self._first = False
        if self.writes:
            write_ledger(self.directory, Ledger(self.run, self.start, step, now, self.data, self.processes))
        return line
