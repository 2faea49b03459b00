"""What the DeepSpeed engine's ranks really hold for parameters, gradients and optimizer states equals
the planner's estimate (issue 6, item 5): cpu_dp4 at ZeRO 0-3 and cpu_tp2_dp2, within 2%.

Measured by :mod:`plugin.engines.memory` inside a gradient accumulation (after one optimizer step, so
Adam's moments exist, and one more backward, so gradients do): the state ZeRO's formulas describe.
"""
import dataclasses

import pytest

from .spawn import run

pytestmark = [pytest.mark.dist, pytest.mark.deepspeed]
pytest.importorskip("deepspeed")

CASES = [("cpu_dp4", 0), ("cpu_dp4", 1), ("cpu_dp4", 2), ("cpu_dp4", 3), ("cpu_tp2_dp2", None)]


def _recipe(name, stage):
    from plugin.checks import load_recipe

    recipe = load_recipe(name)
    if stage is not None:
        recipe = dataclasses.replace(recipe, zero=dataclasses.replace(recipe.zero, stage=stage))
    # two micro-batches per step, so a backward can run inside an accumulation
    return dataclasses.replace(recipe, batch=dataclasses.replace(recipe.batch, micro=recipe.layout().micro_batch // 2))


def _measure(rank, world_size):
    import torch

    import plugin
    from plugin.data import TextBatches
    from plugin.engines.memory import held_bytes
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
        largest = max(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.ds.module.parameters())
        out.append((held_bytes(engine.ds.module, engine.ds.optimizer), largest * 4))
    return out


def test_held_bytes_equal_the_estimate():
    from plugin.recipe_estimate import expected_model_states_for_recipe

    measured = run(_measure, 4, timeout_s=300)
    for i, (name, stage) in enumerate(CASES):
        want = dataclasses.asdict(expected_model_states_for_recipe(_recipe(name, stage)))
        for rank in range(4):
            held, largest = measured[rank][i]
            label = f"{name} ZeRO-{stage if stage is not None else 1} rank {rank}: held {held}, estimate {want}"
            # DeepSpeed's ZeRO-2 keeps whole gradients of the parameters that straddle this rank's partition
            # boundaries: at most two of the largest parameter more than the partition. On this toy model
            # that is up to 20% of the gradients (2.6% of the total); at real sizes it vanishes.
            slack = 2 * largest if stage == 2 else 0
            total_held = sum(held[k] for k in want)
            assert sum(want.values()) * 0.98 <= total_held <= (sum(want.values()) + slack) * 1.02, label
            for kind, value in want.items():
                if kind == "gradients" and slack:
                    assert value <= held[kind] <= value + slack, label
                else:
                    assert held[kind] == pytest.approx(value, rel=0.02), label
