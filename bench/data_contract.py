"""What the data contract's check costs: cpu_dp4 and cpu_tp2_dp2 step time with and without it, side by side.

Every ``train_step`` fingerprints what each rank was given and starts one collective over the world (on gloo an
all-to-all: :mod:`plugin.engines.data_contract`); given the global batch (as here, and as train.py gives it) with the
shapes of the last accepted one, the step takes the verdict after its backward, before its update
(``Engine.rows_checked``), so what the check costs is the time it adds to the step: building and starting it, and
the wait at the verdict if the collective is not done by then. Here, under torchrun with 4 CPU processes (gloo), each
back end (native, and DeepSpeed where installed) trains each recipe on the same global batches, the check on and off
(``engine.check_peer_rows``; off, the loss counts its tokens as it did before the check) in pairs of consecutive
steps, each pair in a random order (the same on every rank), so both halves see the same machine load; each step is
timed between barriers. The table gives the median step time of each, their ratio, "paired diff" (the mean over
pairs of the step with it minus the step without, rank 0, +- two standard errors: on a shared 2-core machine the
step-to-step noise is several ms), and the check's own time inside the steps with it, measured directly as the hang
guard's heartbeat is (``bench/watchdog.py``): "start" (the shapes compared, the fingerprint, the collective started),
"wait" (blocked at the verdict), their sum per step as a share of the step without it (median over steps, the larger
over ranks; the goal: at most 1 %), and "blocking" for comparison: the median of ``--calls`` calls of the same check
waited for at once (start + finish, as a step given shares or new shapes waits), entered together after a barrier.

Usage: python bench/data_contract.py [--steps 30] [--calls 100]   (relaunches itself under torchrun)
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
RECIPES, WARMUP = ("cpu_dp4", "cpu_tp2_dp2"), 3


def worker(steps: int, calls: int) -> None:
    import torch
    import torch.distributed as dist

    import plugin
    import plugin.engines.base as base
    from plugin.data.text import TextBatches
    from plugin.engines import data_contract
    from plugin.engines.batches import target_count
    from plugin.engines.data_contract import start_exchange
    from plugin.models.gpt import GPT, GPTConfig

    spent = {"start": 0.0, "wait": 0.0}

    def timed(fn, key):
        def call(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - begin

        return call

    base.start_exchange = timed(start_exchange, "start")  # what local_batch calls
    base.shapes_of = timed(data_contract.shapes_of, "start")
    data_contract.RowsExchange.finish = timed(data_contract.RowsExchange.finish, "wait")  # the verdict, wherever
    backends = ["native"] + (["deepspeed"] if importlib.util.find_spec("deepspeed") else [])
    rows, last = [], None
    for name in RECIPES:
        recipe = plugin.load_recipe(name)
        for backend in backends:
            torch.manual_seed(0)
            engine = plugin.initialize(GPT(GPTConfig.from_recipe_model(recipe.model)), recipe, backend=backend)
            lay = engine.layout
            data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
            times, own = {True: [], False: []}, []
            order = random.Random(0)  # the same on every rank: each pair of steps in a random order, so that a
            plan = [True] * WARMUP  # pattern of the machine's own (even and odd steps differ here) cannot pose as cost
            for _ in range(steps):
                plan += [True, False] if order.random() < 0.5 else [False, True]
            for step, check in enumerate(plan):
                engine.check_peer_rows = check
                batch = data.global_batch(step, lay.global_batch)
                dist.barrier()
                spent.update(start=0.0, wait=0.0)
                begin = time.perf_counter()
                engine.train_step(batch)
                dist.barrier()
                if step >= WARMUP:
                    times[check].append(time.perf_counter() - begin)
                    if check:
                        own.append((spent["start"], spent["wait"]))
            engine.check_peer_rows = True
            inputs, labels = data.global_batch(0, lay.global_batch)
            local_rows = lay.micro_batch * lay.grad_accum
            cut = slice(engine.data_rank * local_rows, (engine.data_rank + 1) * local_rows)  # this data rank's
            share = (inputs[cut], labels[cut])
            tokens = target_count(share[1], "shifted")
            blocking = []
            for _ in range(calls):
                dist.barrier()
                begin = time.perf_counter()
                start_exchange(share, local_rows, tokens, 0, engine.topology, global_rows=lay.global_batch,
                               local_rows=local_rows, device=engine.device).finish("bench")
                blocking.append(time.perf_counter() - begin)
            pairs = [a - b for a, b in zip(times[True], times[False], strict=True)]  # with minus without, pair by pair
            mine = {"with": statistics.median(times[True]), "without": statistics.median(times[False]),
                    "diff": statistics.mean(pairs), "diff_se": statistics.stdev(pairs) / len(pairs) ** 0.5,
                    "start": statistics.median(a for a, _ in own), "wait": statistics.median(b for _, b in own),
                    "own": statistics.median(a + b for a, b in own), "blocking": statistics.median(blocking)}
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            # the step is as long as its slowest rank; the check's figures: the larger over ranks
            keys = ("with", "without", "start", "wait", "own", "blocking")
            rows.append({**{k: max(g[k] for g in gathered) for k in keys}, "recipe": name, "backend": backend,
                         "diff": gathered[0]["diff"], "diff_se": gathered[0]["diff_se"]})
            last = engine
    if dist.get_rank() == 0:
        print("BENCH " + json.dumps(rows), flush=True)
    last.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps with the check, and as many without")
    parser.add_argument("--calls", type=int, default=100, help="timed calls of the check alone")
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
    print(f"\nThe data contract's check (4 CPU processes, gloo; the global batch given): median of {args.steps} steps "
          f"with it and {args.steps} without, in pairs; the check's own time inside the steps with it; 'blocking': "
          f"median of {args.calls} calls waited for at once (the larger over ranks)\n")
    print(f"{'recipe':<13}{'back end':<11}{'without ms':>11}{'with ms':>9}{'ratio':>7}{'paired diff ms':>17}"
          f"{'start ms':>10}{'wait ms':>9}{'own % of step':>15}{'blocking ms':>13}{'% of step':>11}")
    for r in json.loads(found[-1]):
        diff = f"{1e3 * r['diff']:+.1f} +- {2e3 * r['diff_se']:.1f}"
        print(f"{r['recipe']:<13}{r['backend']:<11}{1e3 * r['without']:>11.1f}{1e3 * r['with']:>9.1f}"
              f"{r['with'] / r['without']:>7.3f}{diff:>17}{1e3 * r['start']:>10.3f}{1e3 * r['wait']:>9.3f}"
              f"{100 * r['own'] / r['without']:>14.2f}%{1e3 * r['blocking']:>13.3f}"
              f"{100 * r['blocking'] / r['without']:>10.2f}%")


if __name__ == "__main__":
    main()
