"""The plugin's DeepSpeed engine against a hand-written ``deepspeed.initialize``, and what each rank holds.

One table, two parts, for cpu_dp4 at ZeRO 0-3 and cpu_tp2_dp2 (4 CPU processes, gloo):

* step time of ``plugin.initialize(...).train_step`` against a hand-written loop over
  ``deepspeed.initialize(model, optimizer, config=...)`` with the same model, weights, optimizer and data.
  The hand-written config is built here from the CLI's export (``to_ds_config``, what ``python -m plugin
  export`` writes), its optimizer block dropped for the torch optimizer passed in, then:
  "same cfg" adds only the engine's documented adjustments (``plugin.engines.deepspeed.config.engine_config``:
  ZeRO buckets sized to the model, step logging off), and the benchmark checks that the result is exactly
  the config the plugin's engine handed DeepSpeed (the wrapper's own overhead, goal ratio <= 1.03);
  "DS defaults" is the export as it is, with DeepSpeed's default bucket sizes (the effect of that sizing).
  The three are stepped in a rotating order (each goes first, second and third equally often); medians;
* parameter, gradient and optimizer-state bytes one rank holds (``plugin.engines.memory``, measured inside a
  gradient accumulation) against the planner's theory (goal: <= 1.02 x theory).

Usage: python bench/engine.py [--steps 20]   (it relaunches itself under ``deepspeed --num_gpus 4``)
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CASES = [("cpu_dp4", 0), ("cpu_dp4", 1), ("cpu_dp4", 2), ("cpu_dp4", 3), ("cpu_tp2_dp2", 1)]


def recipe_for(name, stage):
    from plugin.recipe.checks import load_recipe

    r = load_recipe(name)
    r = dataclasses.replace(r, zero=dataclasses.replace(r.zero, stage=stage))
    return dataclasses.replace(r, batch=dataclasses.replace(r.batch, micro=r.layout().micro_batch // 2))


def hand_config(recipe, model, sized: bool) -> dict:
    """The exported ds_config (``python -m plugin export``) with its optimizer block dropped for a torch
    optimizer; ``sized``: plus the engine's documented adjustments, written out here, not taken from it."""
    from plugin.engines.deepspeed.config import size_buckets
    from plugin.interop.deepspeed_config import to_ds_config

    config = to_ds_config(recipe)
    config.pop("optimizer")
    if sized:
        if config["zero_optimization"]["stage"] >= 1:
            size_buckets(config["zero_optimization"], [p.numel() for p in model.parameters()], recipe.layout().data)
        config["steps_per_print"] = 2 ** 31 - 1
    return config


def hand_step(engine, loss_fn, dp_rank, lay, batch):
    """A hand-written DeepSpeed step: this data rank's rows, micro-batch by micro-batch."""
    from plugin.engines.batches import micro_batches, shard_rows

    local = shard_rows(batch, dp_rank, lay.data)
    for x, y in micro_batches(local, lay.grad_accum):
        engine.backward(loss_fn(engine(x), y))
        engine.step()


def hand_written(recipe, model, sized: bool):
    """What a user writes by hand: a config, a torch optimizer, deepspeed.initialize."""
    import deepspeed

    from plugin.distributed.groups import build_groups
    from plugin.distributed.topology import Topology
    from plugin.engines.optim import WeightDecay, build_optimizer
    from plugin.models.gpt import gpt_loss
    from plugin.tensor_parallel import apply_tensor_parallel

    mpu, tp_group = None, None
    if recipe.parallelism.tensor > 1:
        mpu = build_groups(Topology.from_recipe(recipe))
        tp_group = mpu.tensor_group
        model = apply_tensor_parallel(model, "auto", tp_group)
    config = hand_config(recipe, model, sized)  # buckets sized to this rank's (sharded) parameters
    engine, *_ = deepspeed.initialize(model=model, optimizer=build_optimizer(model.parameters(), recipe.optimizer,
                                                                              WeightDecay.of(model)),
                                      config=config, mpu=mpu)
    return engine, (lambda out, y: gpt_loss(out, y, tp_group))


def worker(steps: int) -> None:
    import torch

    import plugin
    from plugin.data.text import TextBatches
    from plugin.engines.memory import held_bytes
    from plugin.models.gpt import GPT, GPTConfig
    from plugin.planning.for_recipe import expected_model_states_for_recipe

    rows = []
    for name, stage in CASES:
        recipe = recipe_for(name, stage)
        torch.manual_seed(0)
        ours = plugin.initialize(GPT(GPTConfig.from_recipe_model(recipe.model)), recipe)
        hands = []
        for sized in (True, False):
            torch.manual_seed(0)
            hands.append(hand_written(recipe, GPT(GPTConfig.from_recipe_model(recipe.model)), sized))
        if hands[0][0].config != ours.ds.config:
            raise SystemExit(f"{name} ZeRO-{stage}: the plugin's engine passed DeepSpeed another config than the "
                             f"export plus its documented adjustments:\n{ours.ds.config}\n{hands[0][0].config}")
        lay, data = ours.layout, TextBatches(recipe.model.vocab, recipe.model.seq_len)

        t_ours, t_same, t_default = [], [], []
        runs = ((ours.train_step, t_ours), (functools.partial(hand_step, *hands[0], ours.dp_rank, lay), t_same),
                (functools.partial(hand_step, *hands[1], ours.dp_rank, lay), t_default))
        for step in range(steps + 3):
            batch = data.global_batch(step, lay.global_batch)
            turn = step % len(runs)  # rotate who goes first: no engine always runs on a cache the other warmed
            for fn, times in runs[turn:] + runs[:turn]:
                torch.distributed.barrier()
                start = time.perf_counter()
                fn(batch)
                torch.distributed.barrier()
                if step >= 3:  # warm-up steps are not timed
                    times.append(time.perf_counter() - start)
        x, y = ours.micro_batches(data.global_batch(steps + 3, lay.global_batch))[0]
        ours.ds.backward(ours.loss_fn(ours.ds(x), y))
        held = held_bytes(ours.ds.module, ours.ds.optimizer)
        theory = dataclasses.asdict(expected_model_states_for_recipe(recipe))
        default_other = held_bytes(hands[1][0].module, hands[1][0].optimizer)["other"]
        rows.append({"case": f"{name} ZeRO-{stage}", "ours_ms": 1e3 * statistics.median(t_ours),
                     "same_ms": 1e3 * statistics.median(t_same), "default_ms": 1e3 * statistics.median(t_default),
                     "held": held, "theory": theory, "default_other": default_other})
    if torch.distributed.get_rank() == 0:
        print("BENCH " + json.dumps(rows), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.steps)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", "4", "--master_port", str(port),
           __file__, "--worker", "--steps", str(args.steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    finally:  # the hand-written engines never release DeepSpeed's shm buffers; the launch as a whole does
        from plugin.engines.shm import release_shm_buffers_of_launch

        release_shm_buffers_of_launch(port)
    lines = [line for line in out.stdout.splitlines() if line.startswith("BENCH ")]
    if out.returncode or not lines:
        sys.exit(f"benchmark failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    rows = json.loads(lines[-1][6:])
    print(f"\nStep time, median of {args.steps} steps in rotating order, 4 CPU processes (gloo)\n")
    print(f"{'recipe':<20}{'plugin ms':>10}{'hand, same cfg':>16}{'ratio':>7}{'hand, DS defaults':>19}{'ratio':>7}"
          f"{'DS-default buffers':>20}")
    for r in rows:
        print(f"{r['case']:<20}{r['ours_ms']:>10.1f}{r['same_ms']:>16.1f}{r['ours_ms'] / r['same_ms']:>7.3f}"
              f"{r['default_ms']:>19.1f}{r['ours_ms'] / r['default_ms']:>7.3f}{r['default_other'] / 1e6:>17.1f} MB")
    print("\nBytes one rank holds (rank 0) against theory (ZeRO paper's formulas, fp32 Adam; "
          "plugin.planning.for_recipe)\n")
    print(f"{'recipe':<20}{'kind':<18}{'held':>11}{'theory':>11}{'ratio':>8}")
    for r in rows:
        for kind in ("parameters", "gradients", "optimizer_states"):
            print(f"{r['case']:<20}{kind:<18}{r['held'][kind]:>11,}{r['theory'][kind]:>11,.0f}"
                  f"{r['held'][kind] / r['theory'][kind]:>8.3f}")
        total_h = sum(r["held"][k] for k in r["theory"])
        total_t = sum(r["theory"].values())
        print(f"{'':<20}{'total':<18}{total_h:>11,}{total_t:>11,.0f}{total_h / total_t:>8.3f}"
              f"   (other buffers: {r['held']['other']:,} B)")


if __name__ == "__main__":
    main()
