"""What the data contract's check costs: cpu_tp2_dp2 step time with and without it, side by side.

Every ``train_step`` of a layout with tensor or pipeline > 1 fingerprints this rank's rows and all-gathers the
fingerprints over the world (:mod:`plugin.engines.data_contract`). Here, under torchrun with 4 CPU processes (gloo),
each back end (native, and DeepSpeed where installed) trains cpu_tp2_dp2 on the same global batches, the check on and
off (``engine.check_peer_rows``) in pairs of consecutive steps, each pair in a random order (the same on every rank), so
both halves see the same machine load; each step is timed between barriers. The table gives the median step time of
each, their ratio, and the check alone: the median of ``--calls`` calls of
:func:`plugin.engines.data_contract.check_same_rows` on a step's share, each entered together (after a barrier), in ms
and as a share of the step without it. "paired diff" is the mean over pairs of (the step with it - the step without),
rank 0, +- two standard errors: on a shared 2-core machine the step-to-step noise (several ms) is larger than the check,
so the check's own time is the figure. "barrier": one ``dist.barrier()`` over the world, the floor of any check after
which every rank knows every replica's verdict (a world round-trip); the check is that round plus the fingerprint.

Usage: python bench/data_contract.py [--steps 30] [--calls 200]   (relaunches itself under torchrun)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RECIPE, WARMUP = "cpu_tp2_dp2", 3


def worker(steps: int, calls: int) -> None:
    import torch
    import torch.distributed as dist

    import plugin
    from plugin.data.text import TextBatches
    from plugin.engines.data_contract import check_same_rows, fingerprint
    from plugin.models.gpt import GPT, GPTConfig

    recipe = plugin.load_recipe(RECIPE)
    backends = ["native"] + (["deepspeed"] if importlib.util.find_spec("deepspeed") else [])
    rows = []
    for backend in backends:
        torch.manual_seed(0)
        engine = plugin.initialize(GPT(GPTConfig.from_recipe_model(recipe.model)), recipe, backend=backend)
        lay = engine.layout
        data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
        times = {True: [], False: []}
        order = random.Random(0)  # the same on every rank: each pair of steps in a random order, so that a
        plan = [True] * WARMUP  # pattern of the machine's own (even and odd steps differ here) cannot pose as cost
        for _ in range(steps):
            plan += [True, False] if order.random() < 0.5 else [False, True]
        for step, check in enumerate(plan):
            engine.check_peer_rows = check
            batch = data.global_batch(step, lay.global_batch)
            dist.barrier()
            start = time.perf_counter()
            engine.train_step(batch)
            dist.barrier()
            if step >= WARMUP:
                times[check].append(time.perf_counter() - start)
        engine.check_peer_rows = True
        share = engine.local_batch(data.global_batch(0, lay.global_batch))
        local_rows = lay.micro_batch * lay.grad_accum
        alone, prints, barriers = [], [], []
        for _ in range(calls):
            dist.barrier()
            start = time.perf_counter()
            check_same_rows(share, local_rows, engine.topology, call="bench", global_rows=lay.global_batch,
                            local_rows=local_rows, device=engine.device)
            alone.append(time.perf_counter() - start)
            start = time.perf_counter()
            fingerprint(share, local_rows)
            prints.append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            dist.barrier()  # the floor: any check after which every rank knows every replica's verdict is a round
            barriers.append(time.perf_counter() - start)
        pairs = [a - b for a, b in zip(times[True], times[False], strict=True)]  # with it minus without, pair by pair
        mine = {"backend": backend, "with": statistics.median(times[True]), "without": statistics.median(times[False]),
                "diff": statistics.mean(pairs), "diff_se": statistics.stdev(pairs) / len(pairs) ** 0.5,
                "check": statistics.median(alone), "fingerprint": statistics.median(prints),
                "barrier": statistics.median(barriers)}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        # the step is as long as its slowest rank; the check's figures: the larger over ranks
        rows.append({**{k: max(g[k] for g in gathered) for k in ("with", "without", "check", "fingerprint", "barrier")},
                     "backend": backend, "diff": gathered[0]["diff"], "diff_se": gathered[0]["diff_se"]})
        last = engine
    if dist.get_rank() == 0:
        print("BENCH " + json.dumps(rows), flush=True)
    last.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps with the check, and as many without")
    parser.add_argument("--calls", type=int, default=200, help="timed calls of the check alone")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.steps, args.calls)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", __file__,
           "--worker", "--steps", str(args.steps), "--calls", str(args.calls)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    found = [line[6:] for line in out.stdout.splitlines() if line.startswith("BENCH ")]
    if out.returncode or not found:
        sys.exit(f"benchmark failed ({out.returncode})\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    print(f"\nThe data contract's check on {RECIPE} (4 CPU processes, gloo): median of {args.steps} steps with it and "
          f"{args.steps} without, in pairs; the check alone: median of {args.calls} calls (the larger over ranks)\n")
    print(f"{'back end':<11}{'step without ms':>16}{'with ms':>10}{'ratio':>8}{'paired diff ms':>18}"
          f"{'check alone ms':>16}{'% of step':>11}{'fingerprint ms':>16}{'barrier ms':>12}")
    for r in json.loads(found[-1]):
        diff = f"{1e3 * r['diff']:+.1f} +- {2e3 * r['diff_se']:.1f}"
        print(f"{r['backend']:<11}{1e3 * r['without']:>16.1f}{1e3 * r['with']:>10.1f}{r['with'] / r['without']:>8.3f}"
              f"{diff:>18}{1e3 * r['check']:>16.3f}{100 * r['check'] / r['without']:>10.2f}%"
              f"{1e3 * r['fingerprint']:>16.3f}{1e3 * r['barrier']:>12.3f}")


if __name__ == "__main__":
    main()
