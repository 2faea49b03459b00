"""The plugin's DeepSpeed engine against a hand-written ``deepspeed.initialize``, and what each rank holds.

One table, two parts, for cpu_dp4 at ZeRO 0-3 and cpu_tp2_dp2 (4 CPU processes, gloo):

* step time of ``plugin.initialize(...).train_step`` against a hand-written loop over
  ``deepspeed.initialize(model, optimizer, config=...)`` with the same model, weights, optimizer and data:
  once with the very config the plugin's engine passes (the exported ds_config with buckets sized to the
  model: the wrapper's own overhead, goal ratio <= 1.03), once with the plain export, i.e. DeepSpeed's
  default bucket sizes (the effect of that sizing). All three are stepped in turn; medians compared;
* parameter, gradient and optimizer-state bytes one rank holds (``plugin.engines.memory``, measured inside a
  gradient accumulation) against the planner's theory (goal: <= 1.02 x theory).

Usage: python bench/engine.py [--steps 20]   (it relaunches itself under ``deepspeed --num_gpus 4``)
"""
from __future__ import annotations

import argparse
import dataclasses
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
    from plugin.checks import load_recipe

    r = load_recipe(name)
    r = dataclasses.replace(r, zero=dataclasses.replace(r.zero, stage=stage))
    return dataclasses.replace(r, batch=dataclasses.replace(r.batch, micro=r.layout().micro_batch // 2))


def hand_written(recipe, model, sized: bool):
    """What a user writes by hand: a config, a torch optimizer, deepspeed.initialize."""
    import deepspeed

    from plugin.ds_config import to_ds_config
    from plugin.groups import build_groups
    from plugin.models.gpt import gpt_loss
    from plugin.optim import build_optimizer
    from plugin.tensor_parallel import apply_tensor_parallel
    from plugin.topology import Topology

    from plugin.engines.deepspeed import engine_config

    if sized:  # exactly what the plugin's engine passes to DeepSpeed
        config = engine_config(recipe, recipe.layout().world_size, use_ds_optimizer=False,
                               numels=tuple(p.numel() for p in model.parameters()))
    else:  # `python -m plugin export`, optimizer block dropped for the torch optimizer
        config = to_ds_config(recipe)
        config.pop("optimizer")
    mpu, tp_group = None, None
    if recipe.parallelism.tensor > 1:
        mpu = build_groups(Topology.from_recipe(recipe))
        tp_group = mpu.get_tensor_model_parallel_group()
        model = apply_tensor_parallel(model, "auto", tp_group)
    engine, *_ = deepspeed.initialize(model=model, optimizer=build_optimizer(model.parameters(), recipe.optimizer),
                                      config=config, mpu=mpu)
    return engine, (lambda out, y: gpt_loss(out, y, tp_group))


def worker(steps: int) -> None:
    import torch

    import plugin
    from plugin.data import TextBatches, micro_batches, shard_rows
    from plugin.engines.memory import held_bytes
    from plugin.models.gpt import GPT, GPTConfig
    from plugin.recipe_estimate import expected_model_states_for_recipe

    rows = []
    for name, stage in CASES:
        recipe = recipe_for(name, stage)
        torch.manual_seed(0)
        ours = plugin.initialize(GPT(GPTConfig.from_recipe_model(recipe.model)), recipe)
        hands = []
        for sized in (True, False):
            torch.manual_seed(0)
            hands.append(hand_written(recipe, GPT(GPTConfig.from_recipe_model(recipe.model)), sized))
        lay, data = ours.layout, TextBatches(recipe.model.vocab, recipe.model.seq_len)

        def hand_step(engine, loss_fn, batch):
            local = shard_rows(batch, ours.dp_rank, lay.data)
            for x, y in micro_batches(local, lay.grad_accum):
                engine.backward(loss_fn(engine(x), y))
                engine.step()

        t_ours, t_same, t_default = [], [], []
        runs = ((ours.train_step, t_ours), (lambda b: hand_step(*hands[0], b), t_same),
                (lambda b: hand_step(*hands[1], b), t_default))
        for step in range(steps + 3):
            batch = data.global_batch(step, lay.global_batch)
            for fn, times in runs:
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
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [l for l in out.stdout.splitlines() if l.startswith("BENCH ")]
    if out.returncode or not lines:
        sys.exit(f"benchmark failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    rows = json.loads(lines[-1][6:])
    print(f"\nStep time, median of {args.steps} alternating steps, 4 CPU processes (gloo)\n")
    print(f"{'recipe':<20}{'plugin ms':>10}{'hand, same cfg':>16}{'ratio':>7}{'hand, DS defaults':>19}{'ratio':>7}"
          f"{'DS-default buffers':>20}")
    for r in rows:
        print(f"{r['case']:<20}{r['ours_ms']:>10.1f}{r['same_ms']:>16.1f}{r['ours_ms'] / r['same_ms']:>7.3f}"
              f"{r['default_ms']:>19.1f}{r['ours_ms'] / r['default_ms']:>7.3f}{r['default_other'] / 1e6:>17.1f} MB")
    print("\nBytes one rank holds (rank 0) against theory (ZeRO paper's formulas, fp32 Adam; "
          "plugin.recipe_estimate)\n")
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
