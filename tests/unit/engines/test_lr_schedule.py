"""The engines' LambdaLR gives the recipe's formula, moves once per step, and resumes at a saved position."""
import pytest
import torch

from plugin.engines.lr_schedule import build_lr_schedule
from plugin.recipe.checks import load_recipe
from plugin.recipe.lr_schedule import lr_at
from plugin.recipe.spec import Recipe

SCHEDULE = {"warmup_steps": 3, "decay": "cosine", "decay_steps": 8, "min_lr": 0.03}


def _setup(schedule=SCHEDULE):
    recipe = Recipe.from_dict({**load_recipe("cpu_single").to_dict(), "optimizer": {"name": "sgd", "lr": 0.3},
                               "lr_schedule": schedule})
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.3)
    return recipe, opt, build_lr_schedule(opt, recipe)


def test_the_update_of_step_s_uses_the_formulas_rate():
    recipe, opt, schedule = _setup()
    for step in range(1, 13):
        assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(recipe.lr_schedule, 0.3, step), abs=1e-15)
        opt.step()
        schedule.step()
    assert schedule.position == 12


def test_a_loaded_position_sets_the_optimizers_lr():
    recipe, opt, schedule = _setup()
    schedule.load_state_dict({"position": 5})  # 5 steps taken: the next update is step 6
    assert schedule.position == 5 and opt.param_groups[0]["lr"] == pytest.approx(lr_at(recipe.lr_schedule, 0.3, 6))
    schedule.load_state_dict({"position": 0})
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


def test_no_schedule_no_scheduler():
    assert build_lr_schedule(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1),
                             load_recipe("cpu_single")) is None
