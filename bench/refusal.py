"""How soon a launched job that cannot run stops: a world of 2 processes started for cpu_dp4 (a recipe for 4).

Every rank refuses on its own before any process group exists (plugin.engines.initialize), so no rank waits for a
peer: the time is each process's imports and the check. The tests assert only a generous ceiling
(tests/dist/test_refusal.py, tests/dist/test_deepspeed_parity.py: 60 s, where a hang would wait minutes); this
prints what it takes, side by side with ``python -c "import torch"``, the floor of any start:

* by hand: two plain ``python train.py`` processes with RANK / WORLD_SIZE set (no launcher to stop the other);
* ``torchrun --standalone --nproc_per_node 2``;
* ``deepspeed --num_gpus 2`` (where installed).

Seconds from the start of the command until every process has exited, the median of ``--repeats`` runs.
Usage: python bench/refusal.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [str(ROOT / "train.py"), "--recipe", "cpu_dp4", "--steps", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra) -> dict:
    out = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", **extra)
    out["PYTHONPATH"] = str(ROOT) + (os.pathsep + out["PYTHONPATH"] if out.get("PYTHONPATH") else "")
    return out


def by_hand() -> float:
    port, start, procs = str(free_port()), time.perf_counter(), []
    for rank in range(2):
        procs.append(subprocess.Popen([sys.executable, *TRAIN], cwd=ROOT, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL,
                                      env=env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                                              LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)))
    codes = [p.wait(timeout=600) for p in procs]
    took = time.perf_counter() - start
    if 0 in codes:
        raise SystemExit(f"a rank of a world of 2 trained cpu_dp4: exit codes {codes}")
    return took


def launched(cmd: list[str]) -> float:
    start = time.perf_counter()
    code = subprocess.run(cmd, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          timeout=600).returncode
    took = time.perf_counter() - start
    if code == 0:
        raise SystemExit(f"{' '.join(cmd)} trained cpu_dp4 on 2 processes (exit 0)")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cases = {"python -c 'import torch' (the floor)": lambda: launched_ok([sys.executable, "-c", "import torch"]),
             "by hand, 2 processes": by_hand,
             "torchrun --nproc_per_node 2": lambda: launched([sys.executable, "-m", "torch.distributed.run",
                                                              "--standalone", "--nproc_per_node", "2", *TRAIN])}
    if importlib.util.find_spec("deepspeed"):
        deepspeed = str(Path(sys.executable).with_name("deepspeed"))
        cases["deepspeed --num_gpus 2"] = lambda: launched([deepspeed, "--num_gpus", "2", "--master_port",
                                                            str(free_port()), *TRAIN])
    print(f"world-size refusal of cpu_dp4 on 2 processes, median of {args.repeats} (load {os.getloadavg()[0]:.1f})")
    print(f"{'case':40s} {'seconds':>8s} {'min':>7s} {'max':>7s}")
    for name, case in cases.items():
        times = [case() for _ in range(args.repeats)]
        print(f"{name:40s} {statistics.median(times):8.2f} {min(times):7.2f} {max(times):7.2f}")


def launched_ok(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env(), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
