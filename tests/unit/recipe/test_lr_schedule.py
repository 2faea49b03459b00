"""The recipe's lr_schedule: the formula of issue 22, the schema, the cross-field checks, show's words."""
import json
import math

import pytest

from plugin.recipe.checks import check_recipe, load_recipe
from plugin.recipe.load import recipe_from_data
from plugin.recipe.lr_schedule import describe, lr_at
from plugin.recipe.spec import LRSchedule, Recipe

LR = 0.3


def test_the_formula_step_by_step():
    cos = LRSchedule(warmup_steps=4, decay="cosine", decay_steps=12, min_lr=0.03)
    assert [lr_at(cos, LR, s) for s in (1, 2, 4)] == [LR / 4, LR / 2, LR]
    assert lr_at(cos, LR, 8) == pytest.approx(0.03 + (LR - 0.03) * (1 + math.cos(math.pi / 2)) / 2)
    assert lr_at(cos, LR, 12) == pytest.approx(0.03) and lr_at(cos, LR, 13) == 0.03 and lr_at(cos, LR, 10 ** 6) == 0.03
    lin = LRSchedule(warmup_steps=2, decay="linear", decay_steps=6, min_lr=0.0)
    assert [lr_at(lin, LR, s) for s in range(1, 8)] == pytest.approx([0.15, 0.3, 0.225, 0.15, 0.075, 0.0, 0.0])
    const = LRSchedule(warmup_steps=3)
    assert [lr_at(const, LR, s) for s in (1, 3, 4, 1000)] == pytest.approx([0.1, 0.3, 0.3, 0.3])
    assert lr_at(LRSchedule(), LR, 1) == LR and lr_at(None, LR, 7) == LR
    # no warmup: the decay starts at step 1 from lr (p = s / D); decay_steps == warmup_steps drops to min_lr at once
    assert lr_at(LRSchedule(decay="linear", decay_steps=4), 1.0, 1) == 0.75
    assert lr_at(LRSchedule(warmup_steps=2, decay="cosine", decay_steps=2, min_lr=0.1), 1.0, 3) == 0.1


def _recipe(schedule, **more):
    data = {"name": "s", "parallelism": {"data": 1}, "batch": {"global": 8, "micro": 8},
            "optimizer": {"name": "sgd", "lr": LR}, **({"lr_schedule": schedule} if schedule else {}), **more}
    return recipe_from_data(data, "s.json")


def test_the_schema_takes_the_block_and_refuses_bad_values():
    recipe, problems = _recipe({"warmup_steps": 10, "decay": "cosine", "decay_steps": 100, "min_lr": 0.003})
    assert not [p for p in problems if p.is_error] and recipe.lr_schedule.decay_steps == 100
    assert Recipe.from_dict(recipe.to_dict()) == recipe  # JSON keys are the field names
    recipe, problems = _recipe({"warmup_steps": -1, "decay": "exponential", "decay_step": 5})
    paths = sorted(p.path for p in problems if p.is_error)
    assert recipe is None and paths == ["$.lr_schedule.decay", "$.lr_schedule.decay_step",
                                        "$.lr_schedule.warmup_steps"], paths
    assert any('did you mean "decay_steps"' in p.format() for p in problems)


@pytest.mark.parametrize("schedule, path, words", [
    ({"decay": "linear"}, "$.lr_schedule.decay_steps", "needs the step where it reaches min_lr"),
    ({"warmup_steps": 50, "decay": "cosine", "decay_steps": 20}, "$.lr_schedule.decay_steps",
     "decay_steps 20 < warmup_steps 50"),
    ({"decay": "cosine", "decay_steps": 20, "min_lr": 0.5}, "$.lr_schedule.min_lr", "min_lr 0.5 > the optimizer's lr"),
])
def test_checks_refuse_a_schedule_that_cannot_be(schedule, path, words):
    recipe, _ = _recipe(schedule)
    errors = [p for p in check_recipe(recipe, 1) if p.is_error]
    assert [p.path for p in errors] == [path] and words in errors[0].message and errors[0].hint, errors


def test_constant_with_decay_fields_warns_and_a_raw_deepspeed_scheduler_is_refused():
    recipe, _ = _recipe({"warmup_steps": 5, "decay_steps": 50})
    assert [(p.path, p.is_error) for p in check_recipe(recipe, 1)] == [("$.lr_schedule.decay", False)]
    warmup = {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}
    recipe, _ = _recipe({"warmup_steps": 5}, deepspeed={"scheduler": warmup})
    errors = [p for p in check_recipe(recipe, 1) if p.is_error]
    assert [p.path for p in errors] == ["$.deepspeed.scheduler"] and "second time" in errors[0].message
    recipe, _ = _recipe(None, deepspeed={"scheduler": warmup})  # DeepSpeed's alone: its own business, as before
    assert not [p for p in check_recipe(recipe, 1) if p.is_error]


def test_show_and_describe_say_the_schedule(capsys):
    from plugin.cli.main import main

    assert describe(LRSchedule(warmup_steps=100, decay="cosine", decay_steps=1000, min_lr=3e-5), 3e-4) == \
        "warmup 100 steps from 0 to 0.0003, cosine decay to 3e-05 at step 1000, then 3e-05"
    assert describe(None, 0.001) == "constant 0.001"
    assert main(["show", "cpu_single", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["resolved"]["lr_schedule"] == "constant 0.003"
    assert load_recipe("cpu_single").lr_schedule is None
