"""The watchdog's store server (plugin.watchdog.store.StoreServer): served by a fork where nothing can be half-held,
else by a fresh interpreter, and either way a client can use it and ``stop`` leaves no process behind."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

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


def test_a_thread_alive_starts_a_fresh_interpreter_not_a_fork():
    """The case that hung CI for 15 min: a process whose earlier engine's threads still run forks its server."""
    from plugin.watchdog.store import StoreServer, _fork_is_safe

    stop = threading.Event()
    busy = threading.Thread(target=stop.wait, daemon=True)
    busy.start()
    try:
        assert not _fork_is_safe()
        server = StoreServer.start(linger_s=1.0, prefix="p/")
        assert server._popen is not None, "a fork was taken with another thread alive"
        with open(f"/proc/{server.pid}/cmdline", "rb") as f:
            assert b"_serve" in f.read()  # the fresh interpreter, not a copy of this one
        _use_and_stop(server)
    finally:
        stop.set()


def test_a_lone_thread_forks():
    """No other thread and no process group: the cheap fork (in a clean interpreter: pytest's may run threads)."""
    code = textwrap.dedent("""
        import os
        from plugin.watchdog.store import StoreServer, _fork_is_safe
        assert _fork_is_safe()
        server = StoreServer.start(linger_s=1.0, prefix="p/")
        assert server._popen is None
        from datetime import timedelta
        from torch.distributed import TCPStore
        client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30),
                          wait_for_workers=False)
        client.set("k", "v"); assert client.get("k") == b"v"
        server.stop()
        try:
            os.kill(server.pid, 0)
        except ProcessLookupError:
            print("gone")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "gone", out.stderr[-2000:]


def test_a_server_that_never_answers_is_named_within_the_limit(monkeypatch):
    from plugin.watchdog.store import StoreServer

    read, write = os.pipe()  # a "child" that holds its end open and says nothing
    server = StoreServer(pid=2 ** 22 + 12345, read_fd=read)
    monkeypatch.setattr(StoreServer, "START_LIMIT_S", 0.5)
    try:
        with pytest.raises(RuntimeError, match="did not start: no port within 0.5 s"):
            _ = server.port
    finally:
        os.close(write)
