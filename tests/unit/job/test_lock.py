"""One job per --save directory (plugin.job.lock): taken, refused naming the holder, stale holders taken over, the
same run taking over its own lock, released only by its holder, the timestamp refreshed while it lives."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from plugin.job.lock import (
    LOCK_NAME,
    Holder,
    JobLockedError,
    SaveLock,
    is_stale,
    live_holder,
    read_holder,
    run_id,
    save_refusal,
)


def _write(directory, **fields):
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "run_id": "other", "started": time.time(),
              "refreshed": time.time(), **fields}
    (directory / LOCK_NAME).write_text(json.dumps(holder))


def test_a_lock_is_taken_named_and_released(tmp_path):
    lock = SaveLock(tmp_path / "ck", "run-a").acquire()
    holder = read_holder(tmp_path / "ck")
    assert (holder.host, holder.pid, holder.run_id) == (socket.gethostname(), os.getpid(), "run-a")
    with pytest.raises(JobLockedError) as e:
        SaveLock(tmp_path / "ck", "run-b").acquire()
    assert str(e.value).startswith(f"--save {tmp_path / 'ck'}: another job is training into this directory: run "
                                   f"run-a (pid {os.getpid()} on {socket.gethostname()}, started ")
    assert "-> wait for it to end, or stop it (Ctrl-C: it saves its step), or give another --save directory" in \
        str(e.value)
    assert save_refusal(tmp_path / "ck", resume=True) == str(e.value)  # launch.sh's check says the same
    lock.release()
    assert read_holder(tmp_path / "ck") is None and save_refusal(tmp_path / "ck", resume=True) is None
    with SaveLock(tmp_path / "ck", "run-b"):
        assert read_holder(tmp_path / "ck").run_id == "run-b"
    assert not (tmp_path / "ck" / LOCK_NAME).exists()


def test_a_dead_holder_on_this_host_is_stale_at_once_and_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _write(tmp_path, pid=int(dead.stdout))  # a pid that has exited (its lock fresh)
    assert live_holder(tmp_path) is None
    lock = SaveLock(tmp_path, "mine").acquire()
    assert lock.took_over.pid == int(dead.stdout) and read_holder(tmp_path).run_id == "mine"
    lock.release()


def test_another_host_s_holder_is_stale_only_once_it_stopped_refreshing(tmp_path):
    _write(tmp_path, host="elsewhere", pid=1, refreshed=time.time() - 5)
    with pytest.raises(JobLockedError, match=r"run other \(pid 1 on elsewhere, .*alive 5 s ago\)"):
        SaveLock(tmp_path, "mine").acquire()
    _write(tmp_path, host="elsewhere", pid=1, refreshed=time.time() - 31)
    assert is_stale(read_holder(tmp_path))
    SaveLock(tmp_path, "mine").acquire().release()


def test_the_same_run_takes_over_its_own_lock(tmp_path):
    """A restart of one elastic run (the same rendezvous id) continues in its directory."""
    _write(tmp_path, run_id="rdzv-7", pid=1)  # pid 1 lives: only the run id lets it in
    lock = SaveLock(tmp_path, "rdzv-7").acquire()
    assert lock.took_over.pid == 1 and read_holder(tmp_path).pid == os.getpid()
    lock.release()


def test_release_leaves_a_lock_that_another_process_holds(tmp_path):
    lock = SaveLock(tmp_path, "rdzv-7").acquire()
    _write(tmp_path, run_id="rdzv-7", pid=1)  # taken over meanwhile by a restart of the run
    lock.release()
    assert read_holder(tmp_path).pid == 1


def test_the_timestamp_is_refreshed_while_the_holder_lives(tmp_path):
    lock = SaveLock(tmp_path, "r", refresh_s=0.05).acquire()
    first = read_holder(tmp_path).refreshed
    time.sleep(0.3)
    assert read_holder(tmp_path).refreshed > first
    lock.release()


def test_run_id_is_torchrun_s_then_launch_sh_s_then_new():
    assert run_id({"TORCHELASTIC_RUN_ID": "abc", "PLUGIN_RUN_ID": "x"}) == "abc"
    assert run_id({"TORCHELASTIC_RUN_ID": "none", "PLUGIN_RUN_ID": "x"}) == "x"  # accelerate launch sets "none"
    made = run_id({})
    assert len(made) == 12 and made != run_id({})


def test_a_fresh_run_refuses_another_run_s_checkpoints(tmp_path):
    step = tmp_path / "step-00000004"
    step.mkdir()
    (step / "plugin-checkpoint.json").write_text('{"complete": true}')
    (step / ".metadata").write_text("")
    assert save_refusal(tmp_path, resume=False) == (
        f"--save {tmp_path}: holds the complete checkpoints of another run (steps 4); a fresh run's saves would "
        f"replace them -> --resume {tmp_path} to continue that run, or give another --save directory")
    assert save_refusal(tmp_path, resume=True) is None


def test_holder_describe():
    h = Holder(host="h", pid=3, run_id="r", started=0.0, refreshed=100.0)
    assert h.describe(now=102.4).endswith("alive 2 s ago)")
