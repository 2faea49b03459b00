"""One rank's hang guard: its ledger, its heartbeat thread, its pre-flight and what it does at a timeout.

Lifecycle (driven by :func:`plugin.engines.initialize.initialize`; ``Engine.close`` ends it):

1. :func:`prepare`, before the back end builds anything: the job's directory, on CUDA the NCCL environment
   (:func:`plugin.watchdog.settings.nccl_env`), on rank 0, where no launcher agent serves the store, the forked
   store server (:mod:`.store`), and the check-in at the rendezvous store (:mod:`.arrival`; a start that fails
   before the group exists gets :meth:`Guard.start_failed`, which names the ranks that never reached it). A world of
   one gets no guard.
2. :meth:`Guard.join`, once the world's process group exists (each back end calls it through
   ``BuildContext.joined``): the store client, the first ledger, the heartbeat thread, the hook on uncaught
   exceptions, and the pre-flight's first half (every rank runs the same recipe at the same layout).
3. :meth:`Guard.attach`, once the engine exists: every group's timeout, the phase hooks (:mod:`.hooks`), the
   pre-flight's second half (:mod:`.preflight`: one all-reduce per group).
4. :meth:`Guard.stop` at ``Engine.close``; rank 0 then :meth:`Guard.release` s the store server.

The heartbeat thread, as each step begins (the step hook sets ``Ledger.stepped``; the main thread itself makes no
store call) and every :func:`~plugin.watchdog.settings.beat_s`: publishes the ledger (with torch's per-group sequence
numbers); at each beat it also beats (a counter in the store), looks at its successor's beat (rank r + 1 mod world:
each rank is watched by one other, a few store calls per beat whatever the world size), and at whether another
rank declared a timeout. A silent successor for ``timeout_s``, a collective that waited ``timeout_s`` (gloo raises
it in the waiting thread; the guard catches it as it leaves the script uncaught; on NCCL the thread reads the
flight recorder), or a declared timeout: :meth:`Guard.stall`, the report, the exit. Every store call is bounded
(:class:`~plugin.watchdog.store.BoundedStore`): a store that does not answer for ``timeout_s`` (its host stopped) ends
the job too, each rank's line naming rank 0, on whose host the store runs. Once the report is out, a named rank whose
process is stopped on a live rank's host is ended with SIGKILL: every launcher would wait for it (DeepSpeed's 30 s
after its SIGTERM, which a stopped process never acts on).
"""
from __future__ import annotations

import atexit
import itertools
import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from ..distributed.topology import Topology
from . import settings
from .arrival import Arrival
from .ledger import Ledger
from .store import StoreServer, StoreSilent, agent_serves_store, guard_store
from .verdict import judge, store_silent_line

_GENERATION = itertools.count()  # guards started in this process: the same count on every rank (same build order)
# gloo: "Timed out waiting 20000ms for recv operation", "Application timeout caused pair closure" (a peer's gloo gave up
# first and closed the pair), "Connection closed by peer"
_MARKERS = ("Timed out", "timed out", "timeout caused", "pair closure", "Connection closed", "Connection reset", "NCCL",
            "gloo", "ProcessGroup")


def prepare(recipe, env, device_type: str, job_dir=None) -> Guard | None:
    """This rank's guard, before any process group: None in a world of one (nobody to wait for)."""
    if env.world_size <= 1:
        return None
    timeout_s = float(recipe.watchdog.timeout_s)
    directory = settings.run_dir(job_dir, os.environ)
    directory.mkdir(parents=True, exist_ok=True)
    if device_type == "cuda":
        wanted, notes = settings.nccl_env(directory, os.environ)
        os.environ.update(wanted)
        if env.is_main:
            for note in notes:
                print(f"watchdog: {note}", file=sys.stderr, flush=True)
    prefix = f"plugin-watchdog/{settings.run_id(os.environ)}/{next(_GENERATION)}/"
    server = None
    if env.rank == 0 and not agent_serves_store(os.environ):
        server = StoreServer.start(linger_s=settings.settle_s(timeout_s) + 30, prefix=prefix)
    guard = Guard(recipe, env, directory, server, "nccl" if device_type == "cuda" else "gloo", prefix)
    guard.arrival = Arrival(os.environ, env.rank, env.world_size, timeout_s, prefix)
    return guard


class Guard:
    def __init__(self, recipe, env, directory: Path, server: StoreServer | None, backend: str, prefix: str):
        self.recipe, self.rank, self.world = recipe, env.rank, env.world_size
        self.timeout_s = float(recipe.watchdog.timeout_s)
        self.beat_s = settings.beat_s(self.timeout_s)
        self.directory, self.server, self.backend = directory, server, backend
        self.topology = Topology(**_sizes(recipe.layout(env.world_size)))
        self.ledger = Ledger(env.rank)
        self.prefix = prefix  # the keys of this guard's job in the store (the same on every rank)
        self.arrival: Arrival | None = None
        self.store = self.address = None
        self.store_host: dict | None = None  # rank 0's first ledger: the host the store runs on, for a silent store
        self.groups: dict[str, tuple] = {}
        self.hooks = None
        self._stop = threading.Event()
        self._thread = None
        self._lock = threading.Lock()
        self._stalling = False
        self._previous_hook = None
        self._waits = None  # (ledger version, wall time, pending ops) as _look_at_waits last saw them
        self._traceback = ""

    # ------------------------------------------------------------------ lifecycle
    @property
    def pg_timeout_s(self) -> float:
        return settings.process_group_timeout_s(self.timeout_s, self.backend)

    def join(self, device) -> None:
        """The world's process group exists: connect, publish, start beating, check the layout (pre-flight 1)."""
        from . import collectives
        from .preflight import agree_on_layout

        self.ledger.enter("build")
        if self.arrival is not None:
            self.arrival.stop()
        self.store, self.address = guard_store(os.environ, self.rank, self.server, self.prefix, self.timeout_s)
        self.groups = collectives.groups_of_this_rank()
        self._publish()
        self.store.set(f"groups/{self.rank}", json.dumps({n: list(r) for n, (_, r) in self.groups.items()}))
        self._previous_hook, sys.excepthook = sys.excepthook, self._excepthook
        self._thread = threading.Thread(target=self._beat, daemon=True, name="watchdog-heartbeat")
        self._thread.start()
        # a loop that never calls engine.close(): the heartbeat must not be inside a store call when the interpreter
        # ends (a DeepSpeed run of 13 engines, none closed, aborted at exit: "terminate called without an active
        # exception", SIGABRT after a run that trained right)
        atexit.register(self.stop)
        agree_on_layout(self, device)
        if self.store.check(["ledger/0"]):  # every rank published before the all-gather: rank 0's is there
            self.store_host = json.loads(self.store.get("ledger/0"))

    def attach(self, engine) -> None:
        """The engine exists: every group's timeout, the phase hooks, one all-reduce per group (pre-flight 2)."""
        from . import collectives
        from .hooks import EngineHooks
        from .preflight import check_groups

        collectives.set_timeouts(self.pg_timeout_s)
        self.groups = collectives.groups_of_this_rank()
        self.store.set(f"groups/{self.rank}", json.dumps({n: list(r) for n, (_, r) in self.groups.items()}))
        check_groups(self, engine.device)
        self.hooks = EngineHooks(engine, self.ledger)
        self.hooks.attach()
        self.ledger.enter("user")

    def stop(self) -> None:
        """The job ends normally: no more beats, hooks or exception handling (every rank, before the last barrier)."""
        self._stop.set()
        self.ledger.stepped.set()  # wakes the heartbeat at once
        if self._thread is not None:
            self._thread.join(timeout=self.beat_s + 10)
        if self.hooks is not None:
            self.hooks.detach()
            self.hooks = None  # stop() runs again at exit (atexit): once is enough
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_hook
        if self.arrival is not None:
            self.arrival.stop()
        if self.store is not None:
            self.store.close()

    def start_failed(self, exc: BaseException) -> None:
        """``initialize`` failed on this rank before the world's group existed (``exc``): when the rendezvous never
        completed, this rank's line names the ranks that never checked in, or this rank's unreachable address."""
        if self.store is not None or self.arrival is None or not distributed_failure(exc):
            return
        self.arrival.stop()
        line = self.arrival.line(self.topology)
        if line:
            sys.stderr.flush()
            os.write(sys.stderr.fileno(), (line + "\n").encode())

    def release(self) -> None:
        """Rank 0, after the last barrier: end the store server."""
        if self.server is not None:
            self.server.stop()
            self.server = None

    # ------------------------------------------------------------------ the heartbeat
    def _entry(self, **final) -> dict:
        from .collectives import sequence_numbers

        entry = self.ledger.record()
        entry.update(t=time.time(), seqs=sequence_numbers(self.groups), **final)
        return entry

    def _publish(self) -> None:
        self.store.set(f"ledger/{self.rank}", json.dumps(self._entry()))

    def _beat(self) -> None:
        successor = (self.rank + 1) % self.world
        seen, since, answered = -1, time.monotonic(), time.monotonic()
        next_beat = time.monotonic() + self.beat_s
        while not self._stop.is_set():
            if self.ledger.stepped.wait(max(0.0, next_beat - time.monotonic())):
                self.ledger.stepped.clear()  # a step began: publish it now (a stopped rank's ledger names its step)
                if not self._stop.is_set() and time.monotonic() < next_beat:
                    try:
                        self._publish()
                    except Exception:  # noqa: BLE001 - the beat below judges a silent store
                        pass
                    continue
            if self._stop.is_set():
                return None
            now = time.monotonic()
            next_beat = now + self.beat_s
            try:
                self._publish()
                self.store.add(f"beat/{self.rank}", 1)
                if self.store.add("declared", 0) > 0:
                    return self.stall(None)
                count = self.store.add(f"beat/{successor}", 0)
                answered = now
            except Exception as e:  # noqa: BLE001 - the store does not answer: how long decides
                if now - answered >= self.timeout_s:
                    return self.stall(f"rank {self.rank}: the watchdog's store at {self.address} has not answered "
                                      f"for {now - answered:.0f} s ({type(e).__name__})")
                continue
            if count != seen:
                seen, since = count, now
            elif now - since >= self.timeout_s:
                return self.stall(f"rank {self.rank} heard no heartbeat from rank {successor} for {now - since:.0f} s")
            if self.backend == "nccl" or now - self.ledger.since >= self.timeout_s / 2:
                self._look_at_waits()

    def _look_at_waits(self) -> None:
        """The flight recorder's pending ops, read while the main thread has been in one phase for half the timeout
        (once per phase: gloo retires a collective when it gives up, so at the timeout they are gone), and on NCCL at
        every beat: a collective pending ``timeout_s`` stops the job before NCCL's own watchdog (a later timeout)
        ends the process without a report."""
        from .collectives import flight_record, pending

        version = self.ledger.version
        if self.backend != "nccl" and self._waits is not None and self._waits[0] == version:
            return
        waits = pending(flight_record())
        self._waits = (version, time.time(), waits)
        late = [p for p in waits if p["age_s"] >= self.timeout_s] if self.backend == "nccl" else []
        if late:
            self.stall(f"rank {self.rank} waited {late[0]['age_s']:.0f} s in {late[0]['op']} on group "
                       f"{late[0]['group']}")

    def _excepthook(self, exc_type, exc, tb) -> None:
        if not self._stop.is_set() and distributed_failure(exc):
            self._traceback = "".join(traceback.format_exception(exc_type, exc, tb))
            self.stall(f"rank {self.rank}: {short(_root(exc))}")
        (self._previous_hook or sys.__excepthook__)(exc_type, exc, tb)

    # ------------------------------------------------------------------ the timeout
    def stall(self, cause: str | None):
        """Report and exit (never returns on the thread that runs it; another thread calling meanwhile waits there)."""
        with self._lock:
            first, self._stalling = not self._stalling, True
        if not first:
            if threading.current_thread() is threading.main_thread():
                while True:  # the heartbeat thread reports and ends the process
                    time.sleep(1)
            return None
        from .collectives import abort_all, flight_record, latest

        try:
            entries = flight_record(only_active=False)
            final = self._entry(final=True, pending=self._pending(entries), latest=latest(entries), cause=cause or "",
                                traceback=self._traceback[-4000:])
            self._write(final)
            self.store.set(f"final/{self.rank}", json.dumps(final))
            if cause:
                self.store.compare_set("cause", "", cause)
            self.store.add("declared", 1)
            self._report()
        except Exception as e:  # noqa: BLE001 - no store: say what this rank knows, from its own ledger
            print(self._no_report_line(cause, e), file=sys.stderr, flush=True)
        finally:
            abort_all()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(settings.EXIT_HUNG)

    def _no_report_line(self, cause: str | None, error: Exception) -> str:
        if isinstance(error, StoreSilent):  # the store's host holds the job: rank 0's (its child, or the agent)
            return store_silent_line(self.rank, self.topology, 0, self.store_host, _process_state(self.store_host),
                                     self.address, self.store.silent_s, agent_serves_store(os.environ)) + \
                f"; ledger in {self.directory}"
        return (f"watchdog: rank {self.rank} stops: {cause or 'a peer declared a timeout'} (no report: the watchdog's "
                f"store failed: {type(error).__name__}: {error}); ledger in {self.directory}")

    def _pending(self, entries: list[dict]) -> list[dict]:
        """What this rank waits in now: the flight recorder's pending ops, else (gloo retired them as it gave up) those
        :meth:`_look_at_waits` saw in this same phase that are still the newest op of their group."""
        from .collectives import latest, pending

        now = pending(entries)
        if now or self._waits is None or self._waits[0] != self.ledger.version:
            return now
        _, seen_at, waits = self._waits
        newest = latest(entries)
        return [dict(w, age_s=round(w["age_s"] + time.time() - seen_at, 3)) for w in waits
                if newest.get(w["group"], {}).get("seq") == w["seq"]]

    def _write(self, final: dict) -> None:
        try:
            (self.directory / f"rank-{self.rank:05d}.json").write_text(json.dumps(final, indent=1))
        except OSError:
            pass

    def _report(self) -> None:
        live, ledgers = self._gather(time.monotonic() + settings.settle_s(self.timeout_s))
        groups = {}
        for r in ledgers:
            if self.store.check([f"groups/{r}"]):
                groups.update(json.loads(self.store.get(f"groups/{r}")))
        cause = self.store.get("cause").decode() if self.store.check(["cause"]) else "a collective timed out"
        states = {r: _process_state(e) for r, e in ledgers.items() if r not in live}
        verdict = judge(self.topology, ledgers, live, groups, now=time.time(), timeout_s=self.timeout_s,
                        cause=cause, states=states, run_dir=str(self.directory))
        sys.stderr.flush()
        # one write per line: every rank writes its line at once into the launcher's shared stderr, and print's two
        # writes (the text, the newline) let two ranks' lines run into one (seen under torchrun on a loaded machine)
        os.write(sys.stderr.fileno(), (verdict.line(self.rank) + "\n").encode())
        self.store.add("lines", 1)
        if self.rank == min(live, default=self.rank):
            deadline = time.monotonic() + 3
            while self.store.add("lines", 0) < len(live) and time.monotonic() < deadline:
                time.sleep(0.1)
            print(verdict.report(), file=sys.stderr, flush=True)
            self.store.set("reported", "1")
        else:
            deadline = time.monotonic() + settings.settle_s(self.timeout_s) + 5
            while not self.store.check(["reported"]) and time.monotonic() < deadline:
                time.sleep(0.1)
        for n in verdict.named:  # stopped on this host (/proc): no launcher's SIGTERM ends it, and each waits for it
            if n.why == "stopped":
                _kill(int(ledgers[n.rank]["pid"]))

    def _gather(self, deadline: float) -> tuple[set[int], dict]:
        """Wait until every rank posted its final ledger or its beat stood still two beats long (or ``deadline``)."""
        ranks = range(self.world)
        first = {r: self.store.add(f"beat/{r}", 0) for r in ranks}
        start = time.monotonic()
        while True:
            live = {r for r in ranks if self.store.check([f"final/{r}"])}
            moved = {r for r in ranks if r not in live and self.store.add(f"beat/{r}", 0) != first[r]}
            settled = time.monotonic() - start >= 2 * self.beat_s
            if (settled and not moved) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        ledgers = {}
        for r in ranks:
            key = f"final/{r}" if r in live else f"ledger/{r}"
            if self.store.check([key]):
                ledgers[r] = json.loads(self.store.get(key))
        return live, ledgers


def _sizes(layout) -> dict:
    return {"pp_size": layout.pipeline, "dp_size": layout.data, "tp_size": layout.tensor, "cp_size": layout.context}


def distributed_failure(exc: BaseException) -> bool:
    """Whether an exception is, or was raised from, a collective's timeout or a lost peer (torch's ``DistError``s,
    gloo's and NCCL's RuntimeErrors; torch's pipeline stages re-raise them as "[Stage 0] failed to run forward"),
    rather than an error every rank raises alike."""
    from torch.distributed import DistError

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, DistError) or (isinstance(exc, RuntimeError) and any(m in str(exc) for m in _MARKERS)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _root(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    return exc


def short(exc: BaseException) -> str:
    """``Timed out waiting 20000ms for recv operation to complete``: the first line, without gloo's source path."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", text)[:240]


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:  # gone meanwhile, or not ours
        pass


def _process_state(entry: dict | None) -> str | None:
    """``stopped`` / ``gone`` / ``running`` for a rank's process on this host (``/proc``), else None."""
    import socket

    if not entry or entry.get("host") != socket.gethostname():
        return None
    try:
        with open(f"/proc/{int(entry['pid'])}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return "gone"
    return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone"}.get(state, "running")
