"""DeepSpeed's fp16 in checkpoints (issue 13): at ZeRO-1 and ZeRO-3 (2 ranks, one spawn) the loss scaler's state
and the steps it skipped travel with the fp32 partitions. The initial scale 2**18 overflows fp16 on the first steps,
so by step 4 the scale has moved and steps were skipped: a resume that restarted the scaler would overflow and skip
again where the uninterrupted run did not. Train 4 steps, save, train 4 (the uninterrupted run), load, train the
same 4 again: bit for bit, and the scaler as it was at the save."""
from __future__ import annotations

import json

import pytest

from plugin.engines.choose import importable

from . import spawn

pytestmark = [pytest.mark.dist, pytest.mark.deepspeed,
              pytest.mark.skipif(not importable("deepspeed"), reason="deepspeed not installed")]


def _resume_fp16(rank, world, root, recipes):
    import torch

    import plugin
    from plugin.data.text import TextBatches
    from plugin.models.gpt import GPT, GPTConfig
    from plugin.recipe.checks import load_recipe

    out = {}
    for path in recipes:
        recipe = load_recipe(path)
        torch.manual_seed(0)
        e = plugin.initialize(GPT(GPTConfig.from_recipe_model(recipe.model)), recipe, backend="deepspeed")
        data = TextBatches(recipe.model.vocab, recipe.model.seq_len, seed=0)

        def steps(a, b, e=e, data=data):
            return [e.train_step(data.global_batch(s, e.layout.global_batch)) for s in range(a, b)]

        r = {"first": steps(0, 4), "initial": 2.0 ** 18}
        r["saved"] = e.scaler.state_dict()
        r["stepped"] = bool(e.ds.optimizer.optimizer.state)
        e.save(f"{root}/{recipe.name}")
        r["cont"] = steps(4, 8)
        r["after_cont"] = e.scaler.state_dict()
        e.load(f"{root}/{recipe.name}")
        r["loaded"] = e.scaler.state_dict()
        r["again"] = steps(4, 8)
        r["manifest"] = json.loads(next((root / recipe.name).glob("step-*/plugin-checkpoint.json")).read_text())[
            "scalars"]["scaler"]
        out[recipe.name] = r
    return out


def test_deepspeed_fp16_resume_keeps_the_loss_scale(tmp_path):
    from .runs import recipe_variant

    recipes = [str(recipe_variant("cpu_dp4", tmp_path, f"fp16_zero{z}", precision="fp16",
                                  fp16={"initial_scale_power": 18, "hysteresis": 1}, zero={"stage": z},
                                  parallelism={"data": 2, "tensor": 1, "pipeline": 1},
                                  batch={"global": 16, "micro": 8}, launcher="deepspeed")) for z in (1, 3)]
    results = spawn.run(_resume_fp16, 2, tmp_path, recipes, timeout_s=300)
    for name, r in results[0].items():
        print(f"{name}: scale at the save {r['saved']['cur_scale']:g} (initial {r['initial']:g}), skipped "
              f"{r['saved']['skipped_steps']}; steps 5-8 {r['cont']} / after the load {r['again']}")
        assert r["saved"]["cur_scale"] < r["initial"] and r["saved"]["skipped_steps"] > 0, name  # the test bites
        assert r["stepped"], f"{name}: no step applied before the save: lower initial_scale_power"
        assert r["after_cont"] != r["saved"], name  # the load had something to restore (cur_iter at least)
        assert r["manifest"] == r["saved"] and r["loaded"] == r["saved"], name
        assert r["again"] == r["cont"], name
        assert all(x == x for x in r["first"] + r["cont"]), name  # finite losses (a skipped step's is still one)
