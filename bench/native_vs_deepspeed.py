"""The native back end against the DeepSpeed engine on the same recipes: step time and what each rank holds.

For each recipe (cpu_dp4 at ZeRO 0-3, cpu_tp2_dp2, cpu_pp2_dp2, cpu_tp2_pp2; 4 CPU processes, gloo), both
engines are built in the same processes from the same seed (``plugin.initialize(..., backend=...)``) and
stepped in turn on the same batches; the table shows the median step time of each and the ratio
native / DeepSpeed.

Bytes: parameters, gradients, optimizer states and "other" (what fits none of these: DeepSpeed's gradient
reduction bucket, say) one rank holds (``plugin.engines.memory.held_bytes``, which counts each storage once),
taken inside an optimizer step, when gradients and Adam's moments both exist: the innermost torch
optimizer's ``step`` is wrapped on one step after warm-up (DeepSpeed calls it on its fp32 partitions,
ZeroRedundancyOptimizer on its shard, FSDP2 on the DTensor shards). The larger over the 4 ranks. Tensors
held outside the engine's module and optimizer (activations, DDP's own buckets, FSDP2's gathered copies)
are not in these bytes.

Peak RSS growth (``--rss``, on by default): what the table's bytes leave out, measured per process. Each
(recipe, back end) runs alone in its own torchrun launch of 4 processes (in the shared launch above both
engines live in one process, so their peaks cannot be told apart): torch, deepspeed and the model are
imported and built first, then ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (the process's high-water
resident set, KiB on Linux) is read before ``initialize`` and after WARMUP + 2 steps. The difference is how
far the peak resident memory rose for the engine, its process groups and its training steps (parameters,
gradients, optimizer states, buckets, activations, allocator slack), the larger over the 4 ranks. It is an
upper-bound-ish figure for host RAM, not tensor bytes: glibc keeps freed memory, and shared pages (a
/dev/shm buffer) count in every process that touched them.

Usage: python bench/native_vs_deepspeed.py [--steps 20] [--no-rss] [--only LABEL ...]   (relaunches itself under
torchrun; ``--only "cpu_dp4 ZeRO-2"`` runs the rows of those labels alone)
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
KINDS = ("parameters", "gradients", "optimizer_states", "other")
BACKENDS = ("deepspeed", "native")
WARMUP = 3


def recipe_for(name, stage):
    from plugin.recipe.checks import load_recipe

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


def label_of(name, stage) -> str:
    return f"{name} ZeRO-{recipe_for(name, stage).zero.stage}"


def worker(steps: int, only: list[int]) -> None:
    import torch
    import torch.distributed as dist

    import plugin
    from plugin.data.text import TextBatches
    from plugin.models.gpt import GPT, GPTConfig

    rows = []
    for name, stage in (CASES[i] for i in only):
        recipe = recipe_for(name, stage)
        engines = {}
        for backend in BACKENDS:
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
        rows.append({"case": label_of(name, stage), "ms": {b: 1e3 * statistics.median(t) for b, t in times.items()},
                     "held": {b: {k: max(g[b][k] for g in gathered) for k in KINDS} for b in engines},
                     "same_losses": all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(*losses.values(), strict=True))})
    if dist.get_rank() == 0:
        print("BENCH " + json.dumps(rows), flush=True)
    for engine in engines.values():  # DeepSpeed's close releases its shm buffer, then tears the groups down
        engine.close()


def rss_worker(case: int, backend: str) -> None:
    """One (recipe, back end) alone: how far this process's peak RSS rises over initialize and WARMUP + 2 steps."""
    import importlib.util
    import resource

    import torch
    import torch.distributed as dist

    import plugin
    from plugin.data.text import TextBatches
    from plugin.models.gpt import GPT, GPTConfig

    if importlib.util.find_spec("deepspeed"):
        import deepspeed  # noqa: F401  (imported before the baseline by both back ends alike)
    name, stage = CASES[case]
    recipe = recipe_for(name, stage)
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_recipe_model(recipe.model))
    data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
    batches = [data.global_batch(step, recipe.layout(4).global_batch) for step in range(WARMUP + 2)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    engine = plugin.initialize(model, recipe, backend=backend)
    for batch in batches:
        engine.train_step(batch)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, grown)
    if dist.get_rank() == 0:
        print("RSS " + json.dumps({"case": case, "backend": backend, "kib": max(gathered)}), flush=True)
    engine.close()


def launch(args: list[str]) -> list[str]:
    """Run this file under torchrun (4 processes) with ``args``; its stdout lines."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", __file__, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode:
        sys.exit(f"benchmark failed ({out.returncode}): {' '.join(args)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout.splitlines()


def tagged(lines: list[str], tag: str) -> list:
    return [json.loads(line[len(tag) + 1:]) for line in lines if line.startswith(tag + " ")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS launches (one per recipe and engine)")
    parser.add_argument("--only", nargs="+", metavar="LABEL", help='rows to run, by label ("cpu_dp4 ZeRO-2")')
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cases", help=argparse.SUPPRESS)
    parser.add_argument("--rss-case", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rss-backend", choices=BACKENDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_backend:
        return rss_worker(args.rss_case, args.rss_backend)
    if args.worker:
        return worker(args.steps, [int(i) for i in args.cases.split(",")])
    labels = [label_of(*case) for case in CASES]
    unknown = sorted(set(args.only or []) - set(labels))
    if unknown:
        sys.exit(f"--only {unknown}: no such row; the rows are {labels}")
    only = [i for i, label in enumerate(labels) if not args.only or label in args.only]
    found = tagged(launch(["--worker", "--steps", str(args.steps), "--cases", ",".join(map(str, only))]), "BENCH")
    if not found:
        sys.exit("benchmark printed no BENCH line")
    rows = found[-1]
    rss = {}
    if not args.no_rss:
        for case in only:
            for backend in BACKENDS:
                for r in tagged(launch(["--rss-case", str(case), "--rss-backend", backend]), "RSS"):
                    rss[r["case"], r["backend"]] = r["kib"] * 1024
    print(f"\nNative back end against the DeepSpeed engine: median of {args.steps} alternating steps, "
          "4 CPU processes (gloo); bytes one rank holds inside an optimizer step (the larger over ranks); "
          f"peak RSS growth over initialize + {WARMUP + 2} steps, each engine alone (the larger over ranks)\n")
    columns = ["params", "grads", "optim states", "other", "total"] + ([] if args.no_rss else ["peak RSS +"])
    head = f"{'recipe':<20}{'DS ms':>8}{'native ms':>11}{'ratio':>7}"
    for kind in columns:
        head += f"{kind + ' DS':>16}{'native':>12}{'ratio':>7}"
    print(head + "  same losses")
    for i, r in zip(only, rows, strict=True):
        ds, nat = r["held"]["deepspeed"], r["held"]["native"]
        line = f"{r['case']:<20}{r['ms']['deepspeed']:>8.1f}{r['ms']['native']:>11.1f}" \
               f"{r['ms']['native'] / r['ms']['deepspeed']:>7.2f}"
        pairs = [(ds[k], nat[k]) for k in KINDS] + [(sum(ds.values()), sum(nat.values()))]
        if not args.no_rss:
            pairs.append((rss[i, "deepspeed"], rss[i, "native"]))
        for a, b in pairs:
            line += f"{a:>16,}{b:>12,}{(b / a if a else float('nan')):>7.2f}"
        print(line + f"  {'yes' if r['same_losses'] else 'NO'}")


if __name__ == "__main__":
    main()
