"""The native back end against the DeepSpeed engine on the same recipes: step time and what each rank holds.

For each recipe (cpu_dp4 at ZeRO 0-3, cpu_tp2_dp2, cpu_pp2_dp2, cpu_tp2_pp2; 4 CPU processes, gloo), both
engines are built in the same processes from the same seed (``plugin.initialize(..., backend=...)``) and
stepped in turn on the same batches; the table shows the median step time of each and the ratio
native / DeepSpeed.

Bytes: parameters, gradients and optimizer states one rank holds (``plugin.engines.memory.held_bytes``, which
counts each storage once), taken inside an optimizer step, when gradients and Adam's moments both exist:
the innermost torch optimizer's ``step`` is wrapped on one step after warm-up (DeepSpeed calls it on its fp32
partitions, ZeroRedundancyOptimizer on its shard, FSDP2 on the DTensor shards). The larger over the 4 ranks.

Usage: python bench/native_vs_deepspeed.py [--steps 20]   (it relaunches itself under torchrun, 4 processes)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CASES = [("cpu_dp4", 0), ("cpu_dp4", 1), ("cpu_dp4", 2), ("cpu_dp4", 3), ("cpu_tp2_dp2", None),
         ("cpu_pp2_dp2", None), ("cpu_tp2_pp2", None)]
KINDS = ("parameters", "gradients", "optimizer_states")
WARMUP = 3


def recipe_for(name, stage):
    from plugin.checks import load_recipe

    recipe = load_recipe(name)
    if stage is not None:
        recipe = dataclasses.replace(recipe, zero=dataclasses.replace(recipe.zero, stage=stage))
    return recipe


def innermost(optimizer):
    """The torch optimizer that really steps (inside DeepSpeed's ZeRO wrapper or ZeroRedundancyOptimizer)."""
    for attr in ("optimizer", "optim"):
        inner = getattr(optimizer, attr, None)
        if inner is not None and hasattr(inner, "step"):
            return innermost(inner)
    return optimizer


def measure_in_next_step(engine) -> dict:
    """Arrange for ``held_bytes`` to be taken inside the next optimizer step; returns the dict it fills."""
    from plugin.engines.memory import held_bytes

    if engine.backend == "deepspeed":
        module, outer = engine.ds.module, engine.ds.optimizer
    else:
        module, outer = engine.container, engine.optimizer
    inner, found = innermost(outer), {}
    original = inner.step

    def step(*args, **kwargs):
        found.update(held_bytes(module, outer))
        inner.step = original
        return original(*args, **kwargs)

    inner.step = step
    return found


def worker(steps: int) -> None:
    import torch
    import torch.distributed as dist

    import plugin
    from plugin.data import TextBatches
    from plugin.models.gpt import GPT, GPTConfig

    rows = []
    for name, stage in CASES:
        recipe = recipe_for(name, stage)
        engines = {}
        for backend in ("deepspeed", "native"):
            torch.manual_seed(0)
            engines[backend] = plugin.initialize(GPT(GPTConfig.from_recipe_model(recipe.model)), recipe,
                                                 backend=backend)
        lay = engines["native"].layout
        data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
        times = {b: [] for b in engines}
        held, losses = {}, {b: [] for b in engines}
        for step in range(steps + WARMUP):
            batch = data.global_batch(step, lay.global_batch)
            for backend, engine in engines.items():
                if step == WARMUP:
                    held[backend] = measure_in_next_step(engine)
                dist.barrier()
                start = time.perf_counter()
                losses[backend].append(engine.train_step(batch))
                dist.barrier()
                if step >= WARMUP:
                    times[backend].append(time.perf_counter() - start)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {b: {k: held[b][k] for k in KINDS} for b in held})
        label = f"{name} ZeRO-{recipe.zero.stage}"
        rows.append({"case": label, "ms": {b: 1e3 * statistics.median(t) for b, t in times.items()},
                     "held": {b: {k: max(g[b][k] for g in gathered) for k in KINDS} for b in engines},
                     "same_losses": all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(*losses.values()))})
    if dist.get_rank() == 0:
        print("BENCH " + json.dumps(rows), flush=True)
    engines["native"].close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.steps)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", __file__,
           "--worker", "--steps", str(args.steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [line for line in out.stdout.splitlines() if line.startswith("BENCH ")]
    if out.returncode or not lines:
        sys.exit(f"benchmark failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    rows = json.loads(lines[-1][6:])
    print(f"\nNative back end against the DeepSpeed engine: median of {args.steps} alternating steps, "
          "4 CPU processes (gloo); bytes one rank holds inside an optimizer step (the larger over ranks)\n")
    head = f"{'recipe':<20}{'DS ms':>8}{'native ms':>11}{'ratio':>7}"
    for kind in ("params", "grads", "optim states", "total"):
        head += f"{kind + ' DS':>16}{'native':>10}{'ratio':>7}"
    print(head + "  same losses")
    for r in rows:
        ds, nat = r["held"]["deepspeed"], r["held"]["native"]
        line = f"{r['case']:<20}{r['ms']['deepspeed']:>8.1f}{r['ms']['native']:>11.1f}" \
               f"{r['ms']['native'] / r['ms']['deepspeed']:>7.2f}"
        pairs = [(ds[k], nat[k]) for k in KINDS] + [(sum(ds.values()), sum(nat.values()))]
        for a, b in pairs:
            line += f"{a:>16,}{b:>10,}{(b / a if a else float('nan')):>7.2f}"
        print(line + f"  {'yes' if r['same_losses'] else 'NO'}")


if __name__ == "__main__":
    main()
