"""What ``engine.last_step`` costs: the step report's own time against a whole ``train_step``.

Each ``train_step`` ends with :meth:`plugin.monitor.meter.StepMeter.report`: the peak memory of this rank (CUDA
``max_memory_allocated``, else ``getrusage``) and one all-reduce (MAX) of one number over the world for the largest of
any rank; the loss, the learning rate and the gradient norm are what the step already computed (the norm the back end
clipped with), read, not computed again. Here, under torchrun with 4 CPU processes (gloo), cpu_dp4 trains on each
back end (native, and DeepSpeed where installed), and the report is timed inside every step: the table gives the
median step, the median report and their ratio.

Usage: python bench/last_step.py [--steps 20] [--recipe cpu_dp4]   (relaunches itself under torchrun)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WARMUP = 3


def worker(recipe_name: str, steps: int) -> None:
    import torch
    import torch.distributed as dist

    import plugin
    from plugin.data.text import TextBatches
    from plugin.models.gpt import GPT, GPTConfig

    recipe = plugin.load_recipe(recipe_name)
    rows = []
    for backend in ["native"] + (["deepspeed"] if importlib.util.find_spec("deepspeed") else []):
        torch.manual_seed(0)
        engine = plugin.initialize(GPT(GPTConfig.from_recipe_model(recipe.model)), recipe, backend=backend)
        data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
        report, spent = engine.meter.report, []

        def timed(report=report, spent=spent, **kwargs):
            t = time.perf_counter()
            out = report(**kwargs)
            spent.append(time.perf_counter() - t)
            return out

        engine.meter.report = timed
        step_times = []
        for step in range(WARMUP + steps):
            batch = data.global_batch(step, engine.layout.global_batch)
            dist.barrier()
            t = time.perf_counter()
            engine.train_step(batch)
            step_times.append(time.perf_counter() - t)
        step_ms = statistics.median(step_times[WARMUP:]) * 1e3
        report_ms = statistics.median(spent[WARMUP:]) * 1e3
        rows.append({"backend": backend, "step_ms": step_ms, "report_ms": report_ms, "share": report_ms / step_ms,
                     "last_step": engine.last_step.to_json()})
    if int(os.environ["RANK"]) == 0:
        print("RESULT " + json.dumps(rows))
    engine.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--recipe", default="cpu_dp4")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.recipe, args.steps)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                          __file__, "--worker", "--steps", str(args.steps), "--recipe", args.recipe],
                         capture_output=True, text=True, env=env, timeout=1800)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode or line is None:
        sys.exit(f"the run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    rows = json.loads(line[7:])
    print(f"{args.recipe}, 4 gloo processes, median of {args.steps} steps")
    print(f"{'back end':<10} {'step ms':>9} {'report ms':>10} {'report/step':>12}")
    for r in rows:
        print(f"{r['backend']:<10} {r['step_ms']:>9.1f} {r['report_ms']:>10.3f} {r['share']:>12.2%}")
    print("last step:", json.dumps(rows[-1]["last_step"]))


if __name__ == "__main__":
    main()
