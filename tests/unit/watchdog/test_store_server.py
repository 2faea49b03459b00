"""The watchdog's store server (plugin.watchdog.store.StoreServer): a forked child, replaced by a fresh interpreter
when the fork never answers, and either way a client can use it and ``stop`` leaves no process behind."""
from __future__ import annotations

import os
import time
import types

import pytest

pytest.importorskip("torch")


def _use_and_stop(server) -> None:
    from datetime import timedelta

    from torch.distributed import TCPStore

    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30),
                      wait_for_workers=False)
    client.set("k", "v")
    assert client.get("k") == b"v"
    server.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(server.pid, 0)


def test_the_forked_server_serves_and_stops():
    from plugin.watchdog.store import StoreServer

    server = StoreServer.start(linger_s=1.0, prefix="p/")
    assert server._popen is None
    _use_and_stop(server)


def test_a_fork_that_never_answers_is_replaced_by_a_fresh_interpreter(monkeypatch):
    """What hung CI for 15 min: a fork whose child never says its port (here: a child stuck at once)."""
    import plugin.watchdog.store as store

    monkeypatch.setattr(store, "_serve", lambda *args: time.sleep(3600))  # what the forked child runs
    monkeypatch.setattr(store.StoreServer, "FORK_LIMIT_S", 1.0)
    server = store.StoreServer.start(linger_s=1.0, prefix="p/")
    stuck = server.pid
    port = server.port  # the fresh interpreter imports the module anew: the real _serve
    assert server._popen is not None and server.pid != stuck and port > 0
    with pytest.raises(ProcessLookupError):
        os.kill(stuck, 0)  # the stuck child is killed and reaped
    with open(f"/proc/{server.pid}/cmdline", "rb") as f:
        assert b"_serve" in f.read()
    _use_and_stop(server)


def test_a_server_that_never_answers_is_named_within_the_limit(monkeypatch):
    from plugin.watchdog.store import StoreServer

    read, write = os.pipe()  # a "child" that holds its end open and says nothing
    spawned = types.SimpleNamespace(returncode=None)  # as if already the fresh interpreter
    server = StoreServer(pid=2 ** 22 + 12345, read_fd=read, linger_s=1.0, prefix="", popen=spawned)
    monkeypatch.setattr(StoreServer, "START_LIMIT_S", 0.5)
    try:
        with pytest.raises(RuntimeError, match="did not start: no port within 0.5 s"):
            _ = server.port
    finally:
        os.close(write)
