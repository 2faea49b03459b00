"""A launched world that does not fit the recipe: every rank refuses on its own, before any process group or
back end exists, so this runs in both venvs (with and without deepspeed)."""
import subprocess
import sys
import time

import pytest

from .ports import free_port
from .runs import ROOT, cpu_env

pytestmark = [pytest.mark.dist, pytest.mark.native]


def test_world_size_mismatch_exits_on_each_plain_process(tmp_path):
    """No launcher to stop the others: two processes started by hand (RANK, WORLD_SIZE, ... set here) with a
    recipe for four. Each must exit non-zero on its own within 10 s of its start, and only rank 0 speaks."""
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = cpu_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append((time.perf_counter(), subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), "--recipe", "cpu_dp4", "--steps", "1"], cwd=tmp_path, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    results = []  # (exit code, or None if still running at 10 s; seconds; output)
    for start, proc in procs:
        try:
            out, err = proc.communicate(timeout=max(0.1, start + 10 - time.perf_counter()))
            code = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            (out, err), code = proc.communicate(), None
        results.append((code, time.perf_counter() - start, out + err))
    logs = "\n".join(f"--- rank {r}: exit {code} after {secs:.1f}s\n{text[-2000:]}"
                     for r, (code, secs, text) in enumerate(results))
    assert all(code is not None for code, _, _ in results), "a rank was still running after 10 s\n" + logs
    assert all(code != 0 for code, _, _ in results), logs
    assert results[0][2].count("but the launcher runs 2") == 1 and "launch 4 processes" in results[0][2], logs
    assert "but the launcher runs 2" not in results[1][2], logs
