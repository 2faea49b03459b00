"""The store the ledgers and heartbeats travel through: torch's c10d ``TCPStore``, never one that a rank's own
process serves.

Under torchrun (and ``accelerate launch``, which runs torchrun's agent) the elastic agent serves the job's store in
its own process (``TORCHELASTIC_USE_AGENT_STORE=True``): the guard talks to it as one more client. Elsewhere (the
``deepspeed`` launcher, a hand launch, ``mp.spawn``) rank 0's process serves the rendezvous store, and a stopped
rank 0 freezes it: measured here, a client's ``add`` to a TCPStore whose server process got SIGSTOP waits forever (the
client's timeout does not bound it). So rank 0 forks a small child that serves a TCPStore of its own
(:class:`StoreServer`), before any process group (and its threads) exists, and publishes its port through the
rendezvous store once the group is up; the child serves on when rank 0 stops or dies, long enough for the others to
report, and ends with its parent.

Every call the guard makes goes through :class:`BoundedStore`: a store whose host is stopped or frozen as a whole
(rank 0 with its forked child, a node paused, torchrun's agent stopped) never answers, and a guard blocked in it would
hold the job as long as the hang it exists to end.

Keys live under ``plugin-watchdog/<run>/`` (:func:`plugin.watchdog.settings.run_id`), so a restart of the same job
(torchrun's restart count is part of ``<run>``) never reads a previous attempt's ledgers.
"""
from __future__ import annotations

import functools
import os
import queue
import signal
import threading
import time
from collections.abc import Mapping
from datetime import timedelta

ADDRESS_KEY = "plugin-watchdog/store"


def agent_serves_store(environ: Mapping[str, str]) -> bool:
    """Whether the launcher's agent (torchrun's) serves the rendezvous store in a process of its own."""
    return environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


class StoreServer:
    """A ``TCPStore`` served by a child of rank 0: :attr:`port` (read from the child on first use); :meth:`stop`
    ends it."""

    FORK_LIMIT_S = 20.0  # a forked child says its port within milliseconds
    START_LIMIT_S = 120.0  # a fresh interpreter imports torch first (1.7 s here) on a machine that may be loaded

    def __init__(self, pid: int, read_fd: int, linger_s: float, prefix: str, popen=None):
        self.pid, self._read_fd, self._popen, self._port = pid, read_fd, popen, None
        self._linger_s, self._prefix = linger_s, prefix

    @classmethod
    def start(cls, linger_s: float, prefix: str = "") -> StoreServer:
        """Fork the server (call before any process group exists: the child must not inherit their threads). Once
        its parent is gone it serves until the guard's key ``reported`` under ``prefix`` is set (the survivors'
        report is out) and 5 s more, at most ``linger_s`` seconds, then exits."""
        read, write = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: serve, watch the parent, never return into the caller's code
            code = 1
            try:
                os.close(read)
                _serve(write, parent, linger_s, prefix)
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        return cls(pid, read, linger_s, prefix)

    @property
    def port(self) -> int:
        """The server's port. A forked child silent for :attr:`FORK_LIMIT_S` is replaced by a fresh interpreter
        (then :attr:`START_LIMIT_S` at most, else RuntimeError). Why: a process that builds a second engine forks
        while the first one's heartbeat and store threads run, and a fork copies whatever lock one of them holds
        at that instant; CI once saw rank 0 of such a test wait for its child's port for 15 min (the other ranks
        waiting for rank 0), where the read had no bound."""
        if self._port is None:
            word = _read_word(self._read_fd, self.START_LIMIT_S if self._popen else self.FORK_LIMIT_S)
            if word is None and self._popen is None:
                self.stop()
                self._spawn()
                word = _read_word(self._read_fd, self.START_LIMIT_S)
            if word is None or not word.isdigit():
                self.stop()
                why = f"no port within {self.START_LIMIT_S:g} s" if word is None else word or "no port"
                raise RuntimeError(f"the watchdog's store did not start: {why}")
            self._port = int(word)
        return self._port

    def _spawn(self) -> None:
        """Serve from a fresh interpreter (nothing inherited but the pipe), a child of this process as the fork was."""
        import subprocess
        import sys
        from pathlib import Path

        read, write = os.pipe()
        code = ("import sys; from plugin.watchdog.store import _serve; "
                "_serve(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4])")
        root = str(Path(__file__).resolve().parents[2])  # the plugin importable wherever it was imported from
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self._popen = subprocess.Popen(
            [sys.executable, "-c", code, str(write), str(os.getpid()), repr(self._linger_s), self._prefix],
            pass_fds=(write,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=env)
        os.close(write)
        self.pid, self._read_fd = self._popen.pid, read

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        if self._popen is not None:
            self._popen.returncode = -signal.SIGKILL  # reaped above: Popen must not wait for it again


def _read_word(fd: int, limit_s: float) -> str | None:
    """Everything the child writes to ``fd`` before it closes it (``fd`` closed after), or None when it has not
    closed it within ``limit_s`` seconds."""
    import select

    deadline, chunks = time.monotonic() + limit_s, []
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 512)
            if not chunk:
                return b"".join(chunks).decode()
            chunks.append(chunk)
    finally:
        os.close(fd)


class StoreSilent(RuntimeError):
    """The watchdog's store did not answer a call within the guard's limit."""


class BoundedStore:
    """``store``'s methods (``set``, ``get``, ``add``, ``check``, ...), each given up after ``limit_s``: one worker
    thread makes the calls in order, and while it has been inside one call for ``limit_s`` (the store's server
    stopped: it never returns), that call's caller and every later one get :class:`StoreSilent` at once.
    :attr:`silent_s` says how long the store has not answered; :meth:`close` ends the worker."""

    def __init__(self, store, limit_s: float):
        self.store, self.limit_s = store, float(limit_s)
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._since: float | None = None  # when the worker entered the call it is in (time.monotonic); None: idle
        self._worker = threading.Thread(target=self._work, daemon=True, name="watchdog-store")
        self._worker.start()

    def __getattr__(self, name: str):
        return functools.partial(self._call, getattr(self.store, name))

    @property
    def silent_s(self) -> float:
        since = self._since
        return 0.0 if since is None else time.monotonic() - since

    def _call(self, method, *args):
        done, box = threading.Event(), []
        self._calls.put((method, args, done, box))
        while not done.wait(0.25):
            if self.silent_s >= self.limit_s:
                raise StoreSilent(f"no answer for {self.silent_s:.0f} s")
            if not self._worker.is_alive():
                raise StoreSilent("the guard's store client is closed")
        value, error = box
        if error is not None:
            raise error
        return value

    def _work(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            method, args, done, box = item
            self._since = time.monotonic()
            try:
                box[:] = [method(*args), None]
            except Exception as e:  # noqa: BLE001 - the caller raises it
                box[:] = [None, e]
            finally:
                self._since = None
                done.set()

    def close(self) -> None:
        """End the worker once the calls before this one are done (not waiting for a store that does not answer)."""
        self._calls.put(None)
        self._worker.join(timeout=min(self.limit_s, 5.0))


def _serve(write_fd: int, parent: int, linger_s: float, prefix: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):  # whatever handlers the training script installed are not ours
        signal.signal(sig, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDWR)  # a lingering child must not hold the launcher's pipes open
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    try:
        from torch.distributed import PrefixStore, TCPStore

        server = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        done = PrefixStore(prefix, server)
        os.write(write_fd, str(server.port).encode())
    except Exception as e:  # the parent reads the reason instead of a port
        os.write(write_fd, f"{type(e).__name__}: {e}".encode()[:500])
        raise
    finally:
        os.close(write_fd)
    while os.getppid() == parent:
        time.sleep(0.5)
    deadline = time.monotonic() + linger_s
    while time.monotonic() < deadline and not (prefix and done.check(["reported"])):
        time.sleep(0.5)
    time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))  # the last readers of the report's keys


def connect(host: str, port: int, prefix: str, timeout_s: float = 30.0):
    """A client of the store at ``host:port``, its keys under ``prefix``."""
    from torch.distributed import PrefixStore, TCPStore

    client = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return PrefixStore(prefix, client)


def guard_store(environ: Mapping[str, str], rank: int, server: StoreServer | None, prefix: str,
                timeout_s: float):
    """``(store, "host:port")`` for this rank's guard, once the default process group exists: the agent's store, or
    the one rank 0's :class:`StoreServer` serves (its port published through the rendezvous store), as a
    :class:`BoundedStore` whose calls give up after ``timeout_s``."""
    import torch.distributed as dist

    host = environ.get("MASTER_ADDR", "127.0.0.1")
    if agent_serves_store(environ):
        port = int(environ["MASTER_PORT"])
    else:
        rendezvous = dist.distributed_c10d._get_default_store()
        if rank == 0:
            assert server is not None, "rank 0 starts the watchdog's store server before any process group"
            rendezvous.set(ADDRESS_KEY, str(server.port))
        port = int(rendezvous.get(ADDRESS_KEY).decode())
    return BoundedStore(connect(host, port, prefix, timeout_s), timeout_s), f"{host}:{port}"
