"""Launch train.py for real (python, deepspeed, torchrun, accelerate) and read its metrics."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .ports import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def cpu_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                                      "MASTER_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", **extra)
    return env


def launcher_argv(launcher: str, nproc: int) -> list[str]:
    if launcher == "python":
        assert nproc == 1
        return [sys.executable]
    if launcher == "deepspeed":
        exe = BIN / "deepspeed"
        return [str(exe if exe.exists() else shutil.which("deepspeed")), "--num_gpus", str(nproc),
                "--master_port", str(free_port())]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    if launcher == "accelerate":
        multi = ["--multi_gpu"] if nproc > 1 else []
        return [sys.executable, "-m", "accelerate.commands.launch", *multi, "--num_processes", str(nproc),
                "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
                "--dynamo_backend", "no"]
    raise ValueError(launcher)


def release_deepspeed_shm(port: str) -> None:
    """Remove the /dev/shm all-reduce buffers a `deepspeed` launch on this port left behind: DeepSpeed's CPU shm
    op never unlinks them (about 68 MB per rank, RAM-backed); the engine's close() does, a crashed run does not."""
    from plugin.engines.shm import release_shm_buffers_of_launch

    release_shm_buffers_of_launch(port)


def train(recipe, nproc: int, tmp: Path, *, launcher: str = "deepspeed", steps: int = 10, extra=(),
          timeout: int = 600, expect_ok: bool = True, env=None, every_rank: bool = False) -> Run:
    """Run train.py; ``every_rank``: each rank writes its own metrics (``--metrics ...-{rank}.jsonl``)."""
    metrics = tmp / f"metrics-{time.monotonic_ns()}{'-{rank}' if every_rank else ''}.jsonl"
    cmd = launcher_argv(launcher, nproc) + [str(ROOT / "train.py"), "--recipe", str(recipe), "--steps", str(steps),
                                            "--metrics", str(metrics), *map(str, extra)]
    if env is None:
        env = cpu_env(ACCELERATE_USE_CPU="true") if launcher == "accelerate" else cpu_env()
    start = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, timeout=timeout, env=env)
    finally:
        if launcher == "deepspeed":
            release_deepspeed_shm(cmd[cmd.index("--master_port") + 1])
    run = Run(cmd, out.returncode, out.stdout, out.stderr, time.perf_counter() - start, metrics)
    if expect_ok:
        assert out.returncode == 0, run.log()
    return run


class Run:
    def __init__(self, cmd, returncode, stdout, stderr, seconds, metrics: Path):
        self.cmd, self.returncode, self.stdout, self.stderr = cmd, returncode, stdout, stderr
        self.seconds, self.metrics_path = seconds, metrics  # a path with {rank} in it: one file per rank

    def records_of(self, rank: int) -> list[dict]:
        path = Path(str(self.metrics_path).replace("{rank}", str(rank)))
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    @property
    def records(self) -> list[dict]:
        return self.records_of(0)

    @property
    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.records}

    def losses_of(self, rank: int) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.records_of(rank)}

    @property
    def backend(self) -> str:
        """The back end train.py's summary names ("trained NAME with BACKEND: ..."), or "" if none."""
        found = re.search(r"^trained \S+ with (\w+):", self.stderr, re.M)
        return found.group(1) if found else ""

    def log(self) -> str:
        return (f"$ {' '.join(self.cmd)}\nexit {self.returncode} after {self.seconds:.1f}s\n"
                f"--- stdout\n{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-6000:]}")


def recipe_variant(base: str, tmp: Path, name: str, **changes) -> Path:
    """A copy of a shipped recipe with some top-level blocks replaced (``zero={"stage": 2}``)."""
    from plugin.recipe.load import find_recipe

    data = json.loads(find_recipe(base).read_text())
    data["name"] = name
    data.pop("$schema", None)
    for key, value in changes.items():
        data[key] = value
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    return path


# The parity suites' layouts (DeepSpeed and native): name -> (base recipe, replaced blocks). Each must give the
# losses of `python train.py --recipe cpu_single`.
PARITY_LAYOUTS = {
    "cpu_dp4_zero0": ("cpu_dp4", {"zero": {"stage": 0}}),
    "cpu_dp4_zero1": ("cpu_dp4", {}),
    "cpu_dp4_zero2": ("cpu_dp4", {"zero": {"stage": 2}}),
    "cpu_zero3_dp4": ("cpu_zero3_dp4", {}),  # the shipped recipe: cpu_dp4 at ZeRO-3
    "cpu_tp2_dp2": ("cpu_tp2_dp2", {}),
    "cpu_pp2_dp2": ("cpu_pp2_dp2", {}),
    "cpu_pp2_dp2_zero0": ("cpu_pp2_dp2", {"zero": {"stage": 0}}),  # DeepSpeed's non-ZeRO clipping path
    "cpu_tp2_pp2": ("cpu_tp2_pp2", {}),
    "cpu_tp2_sp_pp2": ("cpu_tp2_sp_pp2", {}),  # sequence slices between stages: DeepSpeed's partitioning off
}
