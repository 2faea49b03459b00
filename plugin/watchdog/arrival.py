"""The pre-flight's first step, before the world's process group exists: every rank checks in at the rendezvous store
(``MASTER_ADDR:MASTER_PORT``, the address every launcher gives its ranks), so that a rendezvous that never completes
is explained. torch raises after ``timeout_s`` on every rank without naming one (measured, torch 2.13, one rank of 4
given another address: rank 0 ``Timed out after 21 seconds waiting for clients. 3/4 clients joined``, ranks 1-2
``wait timeout after 20000ms, keys: /default_pg/0//cpu//0/0``, the key of rank 0, which did arrive); with the
check-ins, the ranks that reached the store name the ones that never did, and a rank that could not reach it says so,
with the address it was given (:func:`plugin.watchdog.verdict.rendezvous_line`).

A thread per rank, from :func:`plugin.watchdog.guard.prepare` on: it tries the address with a plain socket every half
second (quietly, and as long as the start takes: the store is up only once rank 0 enters ``init_process_group``,
after DeepSpeed's import and JIT build, or from the start under torchrun, whose agent serves it), then connects as
one more client, appends its rank to ``arrived``, and reads the count every beat until every rank has checked in
(the list itself only once the count has stood short for half the timeout), then leaves. Its store calls go through
a :class:`~plugin.watchdog.store.BoundedStore`; the explanation reads only what the thread last saw.
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Mapping

from . import settings
from .store import BoundedStore, connect


class Arrival:
    """Rank ``rank``'s check-in at the rendezvous store (see the module); :meth:`line` after a failed start."""

    def __init__(self, environ: Mapping[str, str], rank: int, world: int, timeout_s: float, prefix: str):
        self.rank, self.world, self.timeout_s = rank, world, float(timeout_s)
        self.address = f"{environ.get('MASTER_ADDR', '127.0.0.1')}:{environ.get('MASTER_PORT', '29500')}"
        self.prefix = prefix
        self.arrived: set[int] | None = None  # None until this rank has checked in
        self.error = ""
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="watchdog-arrival")
        self._thread.start()

    def _run(self) -> None:
        host, _, port = self.address.rpartition(":")
        while not self._stop.is_set():
            try:
                socket.create_connection((host, int(port)), timeout=2).close()
                break
            except (OSError, ValueError) as e:  # not up yet (refused), or never (a wrong address)
                self.error = str(e) or type(e).__name__
                self._stop.wait(0.5)
        if self._stop.is_set():
            return
        store = None
        try:
            store = BoundedStore(connect(host, int(port), self.prefix, self.timeout_s), self.timeout_s)
            store.append("arrived", f"{self.rank} ")
            count = store.add("count", 1)
            self.arrived = {self.rank}
            listed = 0
            while count < self.world and not self._stop.wait(settings.beat_s(self.timeout_s)):
                count = store.add("count", 0)
                if count != listed and time.monotonic() - self.started >= self.timeout_s / 2:
                    self.arrived = {int(r) for r in store.get("arrived").decode().split()}
                    listed = count
            if count >= self.world:
                self.arrived = set(range(self.world))
        except Exception as e:  # noqa: BLE001 - what the line says when this rank never checked in
            self.error = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        finally:
            if store is not None:
                store.close()

    def stop(self) -> None:
        """The world's group exists: no more checking (joins the thread for at most a few seconds)."""
        self._stop.set()
        self._thread.join(timeout=5)

    def line(self, topology) -> str | None:
        """What this rank says after a failed rendezvous (None when every rank had checked in)."""
        from .verdict import rendezvous_line

        arrived = self.arrived
        return rendezvous_line(self.rank, topology, None if arrived is None else set(arrived), self.address,
                               time.monotonic() - self.started, self.error)
