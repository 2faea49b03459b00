"""A launched world that does not fit the recipe: every rank refuses on its own, before any process group or
back end exists, with or without deepspeed installed. .ci/run's slow step runs it; the refusal under torchrun and
under deepspeed's launcher is the README suite's (test_native_parity, test_deepspeed_parity)."""
import subprocess
import sys
import time

import pytest

from .ports import free_port
from .runs import ROOT, cpu_env

pytestmark = [pytest.mark.dist, pytest.mark.native]


# A refusal is each rank's imports and the check (seconds; bench/refusal.py measures them), a hang waits out a
# rendezvous or a collective (minutes): the ceiling tells the two apart, and a loaded machine cannot miss it.
CEILING_S = 60


@pytest.mark.slow  # the refusal under torchrun and under deepspeed's launcher stays in the README's suite
def test_world_size_mismatch_exits_on_each_plain_process(tmp_path):
    """No launcher to stop the others: two processes started by hand (RANK, WORLD_SIZE, ... set here) with a
    recipe for four. Each must exit non-zero on its own, not wait for its peers (within :data:`CEILING_S`), and
    only rank 0 speaks."""
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = cpu_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append((time.perf_counter(), subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), "--recipe", "cpu_dp4", "--steps", "1"], cwd=tmp_path, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    results = []  # (exit code, or None if still running at the ceiling; seconds; output)
    for start, proc in procs:
        try:
            out, err = proc.communicate(timeout=max(0.1, start + CEILING_S - time.perf_counter()))
            code = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            (out, err), code = proc.communicate(), None
        results.append((code, time.perf_counter() - start, out + err))
    logs = "\n".join(f"--- rank {r}: exit {code} after {secs:.1f}s\n{text[-2000:]}"
                     for r, (code, secs, text) in enumerate(results))
    print(logs)
    assert all(code is not None for code, _, _ in results), f"a rank was still running after {CEILING_S} s\n" + logs
    assert all(code != 0 for code, _, _ in results), logs
    assert results[0][2].count("but the launcher runs 2") == 1 and "launch 4 processes" in results[0][2], logs
    assert "but the launcher runs 2" not in results[1][2], logs
