"""What the DeepSpeed engine's ranks really hold for parameters, gradients and optimizer states equals
the planner's estimate (issue 6, item 5): cpu_dp4 at ZeRO 0-3 and cpu_tp2_dp2, within 2%.

Measured by :mod:`plugin.engines.memory` inside a gradient accumulation (after one optimizer step, so
Adam's moments exist, and one more backward, so gradients do): the state ZeRO's formulas describe.

Two places where DeepSpeed 0.19.8 holds other bytes than the ZeRO paper's formulas, each held to its exact
value instead of a slack:

- ZeRO-2 gradients: a rank keeps the whole gradient of every parameter its partition touches, the ones
  straddling its boundaries included (:func:`plugin.engines.memory.deepspeed_zero_partition`), not
  2 Psi / N_d. Computed from the model's own parameter sizes and dp; on this toy model it is 6-43% more
  than the formula (a straddler is a large share of a 55k-element partition), at real sizes a few percent.
- ``other``: the gradient reduction bucket, ``reduce_bucket_size`` elements, which ZeRO-1 allocates at a
  micro-batch's first gradient and frees only at the accumulation boundary (so it is alive here), and
  ZeRO-3 keeps; ZeRO-0 has none and ZeRO-2 frees it at the end of each backward. Estimates leave it to
  the fit verdict's reserve (:func:`plugin.planning.memory.usable_memory`).
"""
import dataclasses

import pytest

from .needs import need
from .spawn import run

pytestmark = [pytest.mark.dist, pytest.mark.deepspeed]
need("deepspeed")

CASES = [("cpu_dp4", 0), ("cpu_dp4", 1), ("cpu_dp4", 2), ("cpu_dp4", 3), ("cpu_tp2_dp2", None)]
BUCKET_HELD = {0: False, 1: True, 2: False, 3: True}  # is the reduction bucket alive mid-accumulation?


def _recipe(name, stage):
    from plugin.recipe.checks import load_recipe

    recipe = load_recipe(name)
    if stage is not None:
        recipe = dataclasses.replace(recipe, zero=dataclasses.replace(recipe.zero, stage=stage))
    # two micro-batches per step, so a backward can run inside an accumulation
    return dataclasses.replace(recipe, batch=dataclasses.replace(recipe.batch, micro=recipe.layout().micro_batch // 2))


def _measure(rank, world_size):
    import torch

    import plugin
    from plugin.data.text import TextBatches
    from plugin.engines.memory import held_bytes
    from plugin.engines.optim import WeightDecay
    from plugin.models.gpt import GPT, GPTConfig

    out = []
    for name, stage in CASES:
        recipe = _recipe(name, stage)
        torch.manual_seed(0)
        engine = plugin.initialize(GPT(GPTConfig.from_recipe_model(recipe.model)), recipe)
        data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
        engine.train_step(data.global_batch(0, engine.layout.global_batch))
        x, y = engine.micro_batches(data.global_batch(1, engine.layout.global_batch))[0]
        engine.ds.backward(engine.loss_fn(engine.ds(x), y))
        # the parameter groups the plugin gives DeepSpeed, in order: what ZeRO-1/2 flattens and partitions
        groups = [[p.numel() for p in g["params"]]
                  for g in WeightDecay.of(engine.ds.module).groups(engine.ds.module.parameters(),
                                                                    recipe.optimizer.weight_decay)]
        out.append({"held": held_bytes(engine.ds.module, engine.ds.optimizer), "groups": groups,
                    "bucket": int(engine.ds.zero_reduce_bucket_size())})
    return out


def _dp_rank(name, rank):
    return rank // 2 if name == "cpu_tp2_dp2" else rank  # tensor fastest, then data (plugin.distributed.topology)


def test_held_bytes_equal_the_estimate():
    from plugin.engines.memory import deepspeed_zero_partition
    from plugin.planning.for_recipe import expected_model_states_for_recipe

    measured = run(_measure, 4, timeout_s=300)
    for i, (name, stage) in enumerate(CASES):
        recipe = _recipe(name, stage)
        zero = recipe.zero.stage
        dp = recipe.layout().data
        want = dataclasses.asdict(expected_model_states_for_recipe(recipe))
        for rank in range(4):
            got = measured[rank][i]
            held = got["held"]
            expected = dict(want)
            if zero == 2:  # DeepSpeed's real ZeRO-2 gradient holding, from the parameter sizes and dp
                touched = sum(deepspeed_zero_partition(g, dp, _dp_rank(name, rank))[1] for g in got["groups"])
                expected["gradients"] = 4 * touched  # fp32
                assert expected["gradients"] >= want["gradients"]  # the formula is the floor
            label = (f"{name} ZeRO-{zero} rank {rank}: held {held}, expected {expected} "
                     f"(ZeRO formula {want})")
            for kind, value in expected.items():
                assert held[kind] == pytest.approx(value, rel=0.02), label
            assert sum(held[k] for k in expected) == pytest.approx(sum(expected.values()), rel=0.02), label
            # "other" is the reduction bucket where DeepSpeed keeps one at this point, else nothing
            # (ZeRO-3 adds a 1-byte overflow flag)
            bucket = 4 * got["bucket"] if BUCKET_HELD[zero] else 0
            assert held["other"] == pytest.approx(bucket, abs=16), label
