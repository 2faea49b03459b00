"""Expert parallelism: per-rank parameter and optimizer bytes at expert 1, 2, 4 against the planner, step time against
expert 1 and against experts split over the tensor group, and the dispatch's all-to-all time as a share of the step.

    python bench/expert_parallel.py [--steps 6]

Four gloo processes (one thread each) train the reference GPT with a MoE block in every block (8 experts, top-2,
AdamW, fp32) on the native back end, one layout after another: data 4 at expert 1, 2 and 4, data 2 x tensor 2 at
expert 1 (each expert's columns and rows split over the tensor group, the "tensor-split experts" of today's transformers
plans), and data 4 at expert 1 and 2 under ZeRO-1 and at expert 2 under ZeRO-3 (the experts over the expert-data
group). Measured on every rank after the steps: the parameter and optimizer-state bytes the engine holds
(:meth:`plugin.engines.base.Engine.state_bytes`), against :func:`plugin.planning.memory.expected_model_states` of the
same recipe (goal: within 2 %; under ZeRO less the fp32 copy of each partition that DeepSpeed keeps and the planner
counts, which the native back end has not); the median step time of the slowest rank; and the seconds spent inside
``torch.distributed.all_to_all_single`` (the token counts, the tokens there and the outputs back, forward and
backward) as a share of the step. Times come from 2 shared CPU cores: they say what the dispatch costs on one machine,
not what E accelerators would gain.

A benchmark, not plugin code: it imports torch.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

MODEL = {"layers": 2, "hidden": 128, "heads": 4, "ffn_hidden": 512, "vocab": 256, "seq_len": 64, "dropout": 0.0,
         "moe": {"experts": 8, "top_k": 2, "every": 1, "ffn_hidden": 256}}
LAYOUTS = [("expert 1", {"data": 4, "expert": 1}), ("expert 2", {"data": 4, "expert": 2}),
           ("expert 4", {"data": 4, "expert": 4}), ("tensor-split experts", {"data": 2, "tensor": 2, "expert": 1}),
           # under ZeRO the experts' states (ZeRO-1) or everything of theirs (ZeRO-3) over the expert-data group
           ("expert 1, ZeRO-1", {"data": 4, "expert": 1, "zero_stage": 1}),
           ("expert 2, ZeRO-1", {"data": 4, "expert": 2, "zero_stage": 1}),
           ("expert 2, ZeRO-3", {"data": 4, "expert": 2, "zero_stage": 3})]
GOAL = 0.02


def _recipe(parallelism):
    from plugin.recipe.spec import Recipe

    parallelism = dict(parallelism)
    zero = {"stage": parallelism.pop("zero_stage", 0)}
    return Recipe.from_dict({"name": "bench_ep", "batch": {"global": 16, "micro": 4}, "launcher": "torchrun",
                             "parallelism": {"tensor": 1, "pipeline": 1, **parallelism}, "model": MODEL,
                             "optimizer": {"name": "adamw", "lr": 1e-3}, "precision": "fp32", "zero": zero})


def _rank(rank: int, port: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="4",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="4")
    torch.set_num_threads(1)
    import plugin
    from plugin.data.text import TextBatches
    from plugin.models.gpt import GPT, GPTConfig

    spent = [0.0]
    a2a = dist.all_to_all_single

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return a2a(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    dist.all_to_all_single = timed  # the plugin's collectives call it by name at call time
    rows = []
    for label, parallelism in LAYOUTS:
        recipe = _recipe(parallelism)
        engine = plugin.initialize(lambda recipe=recipe: GPT(GPTConfig.from_recipe_model(recipe.model)), recipe,
                                   seed=0, backend="native")
        data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
        times, shares = [], []
        for step in range(steps):
            batch = data.global_batch(step, engine.layout.global_batch)
            dist.barrier()
            spent[0] = 0.0
            start = time.perf_counter()
            engine.train_step(batch)
            took = time.perf_counter() - start
            if step:  # the first step builds the optimizer's states
                times.append(took)
                shares.append(spent[0] / took)
        held = engine.state_bytes()
        rows.append((label, held["parameters"], held["optimizer_states"], statistics.median(times),
                     statistics.median(shares)))
    torch.save(rows, os.path.join(out, f"{rank}.pt"))
    dist.destroy_process_group()


def _child(rank, port, steps, out):
    import faulthandler

    import torch.distributed as d

    if os.environ.get("BENCH_TRACE"):
        faulthandler.dump_traceback_later(float(os.environ["BENCH_TRACE"]), exit=True,
                                          file=open(os.path.join(tempfile.gettempdir(), f"ep_bench_{rank}.txt"), "w"))
    d.init_process_group("gloo", rank=rank, world_size=4)
    try:
        _rank(rank, port, steps, out)
    except BaseException:
        import traceback

        print(f"rank {rank}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    from plugin.planning.for_recipe import setup_from_recipe, spec_from_recipe
    from plugin.planning.memory import expected_model_states

    with tempfile.TemporaryDirectory() as out:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        mp.spawn(_child, args=(port, args.steps, out), nprocs=4, join=True)
        ranks = [torch.load(os.path.join(out, f"{r}.pt")) for r in range(4)]
    base = max(r[0][3] for r in ranks)
    split = max(r[3][3] for r in ranks)
    print(f"{'layout':<22} {'params/rank':>12} {'planner':>10} {'optim/rank':>12} {'planner':>10} "
          f"{'step s':>8} {'vs E=1':>7} {'vs tp-split':>11} {'all-to-all':>10}")
    ok = True
    for i, (label, parallelism) in enumerate(LAYOUTS):
        recipe = _recipe(parallelism)
        want = expected_model_states(spec_from_recipe(recipe), setup_from_recipe(recipe, 4))
        if recipe.zero.stage:  # the planner counts DeepSpeed's fp32 clone of each ZeRO partition (4 bytes a parameter
            # at fp32, plugin.planning.model_states), which the native back end does not keep: AdamW's 8 of its 12
            want = dataclasses.replace(want, optimizer_states=want.optimizer_states * 8 / 12)
        params = max(r[i][1] for r in ranks)
        optim = max(r[i][2] for r in ranks)
        step = max(r[i][3] for r in ranks)
        share = max(r[i][4] for r in ranks)
        within = all(abs(got / est - 1) <= GOAL for got, est in ((params, want.parameters),
                                                                 (optim, want.optimizer_states)))
        ok &= within
        print(f"{label:<22} {params / 1e6:>10.3f}MB {want.parameters / 1e6:>8.3f}MB {optim / 1e6:>10.3f}MB "
              f"{want.optimizer_states / 1e6:>8.3f}MB {step:>8.3f} {step / base:>7.2f} {step / split:>11.2f} "
              f"{share:>9.0%}" + ("" if within else "  (bytes off the planner by more than 2 %)"))
    print("per-rank bytes within 2 % of the planner on every row" if ok else "some rows are off the planner")


if __name__ == "__main__":
    main()
