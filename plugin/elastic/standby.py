"""A node none of whose processes train at this start stands by, so that it stays in the job (pure: no torch).

torch 2.13's elastic agent ends its part of a job once every worker of its node has exited 0
(``agent/server/api.py``, ``_invoke_run``: SUCCEEDED, then ``_exit_barrier``). Its node would then be lost to the
job, as seen here with three localhost agents of which one trained none: it waits up to 300 s in that barrier for the
others' end; its rendezvous heartbeats stop meanwhile (its store client waits in the barrier), so a restart goes on
without it; and at 300 s it shuts the rendezvous down (``launcher/api.py``): a later loss then ends the job
(``RendezvousClosedError``), a new node is refused, and where that agent hosted the rendezvous store the job ends at
once (``RendezvousConnectionError``).

So the node's first process does not exit: :func:`stand_by` holds a connection to the training world's store (rank
0's, ``MASTER_ADDR:MASTER_PORT``) while that world trains. Its agent stays healthy, takes part in every restart
(which stops this process like any worker) and is back in the next start. When rank 0's process ends, the run's
ledger (:mod:`.ledger`) says whether the run reached its last step: then it exits 0 and its agent ends with the
others. Otherwise a restart is on its way; if none comes within ``orphan_s`` (the job failed for good), it exits 1.
"""
from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from .ledger import read_ledger

ORPHAN_S = 600.0  # no training world seen this long (rank 0's start-up included): the job is gone
POLL_S = 1.0


def finished(save_dir: str | Path, steps: int) -> bool:
    """Whether the run in ``save_dir`` has trained its last step (rank 0's ledger says so)."""
    ledger = read_ledger(save_dir)
    return ledger is not None and ledger.step >= steps


def hold(address: tuple[str, int], poll_s: float = POLL_S) -> bool:
    """Connect to ``address`` and keep the connection until the other side closes it. False when nothing listens
    there. It returns to Python every ``poll_s``, so that a signal's handler (a restart's SIGTERM) runs at once."""
    try:
        conn = socket.create_connection(address, timeout=poll_s)
    except OSError:
        return False
    with conn:
        conn.settimeout(poll_s)
        while True:
            try:
                if not conn.recv(1):  # the store never writes to a client that sends nothing: only its end
                    return True
            except TimeoutError:
                continue
            except OSError:  # reset: the process is gone
                return True


def stand_by(save_dir: str | Path, steps: int, environ: Mapping[str, str], *, orphan_s: float = ORPHAN_S,
             poll_s: float = POLL_S, clock: Callable[[], float] = time.monotonic) -> int:
    """Stay while this start's training world is up (or on its way up); 0 once the run has trained ``steps``, 1
    after ``orphan_s`` without a training world. A restart ends it earlier, as it ends every worker."""
    address = (environ.get("MASTER_ADDR", "127.0.0.1"), int(environ.get("MASTER_PORT", "29500")))
    seen = clock()
    while True:
        if hold(address, poll_s):
            seen = clock()
        if finished(save_dir, steps):
            return 0
        if clock() - seen > orphan_s:
            print(f"elastic: the node standing by saw no training world at {address[0]}:{address[1]} for "
                  f"{orphan_s:.0f} s and the run in {save_dir} has not reached step {steps}: it exits 1 (its agent "
                  "then restarts it, or ends where the job has ended)", file=sys.stderr, flush=True)
            return 1
        time.sleep(poll_s)
