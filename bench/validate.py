"""Time until a user learns that a recipe is wrong: the plugin's validate against DeepSpeed's own path.

Prints one table, side by side, with ratios against the DeepSpeed references:

* ``python -m plugin validate`` on every shipped recipe (one process), and on one bad recipe;
* DeepSpeed's path to the same mistake: ``deepspeed --num_gpus 2`` on a script whose ds_config has a bad
  batch triple (the error only appears inside ``deepspeed.initialize``, once per rank);
* ``python -c "import deepspeed"``, the floor of anything that goes through DeepSpeed.

Goals (issue 2): all shipped recipes <= 0.15 s; <= 1/50 of DeepSpeed's time-to-error; <= 1/10 of its import.
Usage: python bench/validate.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from plugin.engines.shm import release_shm_buffers_of_launch  # noqa: E402  (no torch import)

BAD_TRIPLE_SCRIPT = """
import torch, deepspeed
model = torch.nn.Linear(8, 8)
config = {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
"""


def timed(cmd, env=None, expect_fail=False) -> tuple[float, str]:
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    took = time.perf_counter() - start
    failed = out.returncode != 0
    if failed != expect_fail:
        raise SystemExit(f"{' '.join(map(str, cmd))} exited {out.returncode}, expected "
                         f"{'failure' if expect_fail else 'success'}:\n{out.stderr[-2000:]}")
    return took, out.stdout + out.stderr


def median(cmd, repeats, **kw) -> tuple[float, str]:
    runs = [timed(cmd, **kw) for _ in range(repeats)]
    return statistics.median(t for t, _ in runs), runs[-1][1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    py = sys.executable
    shipped = sorted(str(p) for p in (ROOT / "recipes").glob("*.json"))
    bad = ROOT / "tests" / "data" / "invalid" / "batch_triple_inconsistent.json"

    rows = []
    t_all, _ = median([py, "-m", "plugin", "validate", *shipped], args.repeats)
    rows.append((f"plugin validate, {len(shipped)} shipped recipes", t_all))
    t_bad, text_bad = median([py, "-m", "plugin", "validate", str(bad)], args.repeats, expect_fail=True)
    rows.append(("plugin validate, bad batch triple", t_bad))

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    t_import, _ = median([py, "-c", "import deepspeed"], args.repeats, env=env)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "bad_triple.py"
        script.write_text(BAD_TRIPLE_SCRIPT)
        ds = Path(py).with_name("deepspeed")
        runs = []
        for _ in range(max(1, args.repeats // 2)):
            port = free_port()
            try:
                runs.append(timed([str(ds), "--num_gpus", "2", "--master_port", str(port), str(script)], env=env,
                                  expect_fail=True))
            finally:  # the ranks crash on purpose, before DeepSpeed could unlink its shm buffers
                release_shm_buffers_of_launch(port)
        t_ds, text_ds = statistics.median(t for t, _ in runs), runs[-1][1]
    assert "train_batch_size is not equal" in text_ds, text_ds[-2000:]
    tracebacks = text_ds.count("Traceback (most recent call last)")

    print(f"\nTime until the user learns the recipe is wrong (median of {args.repeats}; DeepSpeed launch "
          f"median of {len(runs)})\n")
    print(f"{'path':<48}{'seconds':>9}{'vs DS error':>13}{'vs DS import':>14}")
    print("-" * 84)
    for name, t in rows:
        print(f"{name:<48}{t:>9.3f}{t / t_ds:>13.4f}{t / t_import:>14.3f}")
    label = 'python -c "import deepspeed"'
    print(f"{label:<48}{t_import:>9.3f}{t_import / t_ds:>13.4f}{1:>14.3f}")
    print(f"{'deepspeed --num_gpus 2, bad triple (' + str(tracebacks) + ' tracebacks)':<48}{t_ds:>9.3f}{1:>13.4f}"
          f"{t_ds / t_import:>14.3f}")
    print()
    goals = [("all shipped recipes <= 0.15 s", t_all <= 0.15),
             ("bad recipe <= 1/50 of DeepSpeed's time-to-error", t_bad <= t_ds / 50),
             ("bad recipe <= 1/10 of `import deepspeed`", t_bad <= t_import / 10)]
    for goal, met in goals:
        print(f"  [{'met' if met else 'MISSED'}] {goal}")
    print("\nplugin's message:\n  " + text_bad.strip().replace("\n", "\n  "))


if __name__ == "__main__":
    main()
