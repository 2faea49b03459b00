"""The expert axis's recipe rules (plugin/recipe/checks.py check_expert): each refusal at its JSON path with a fix,
all at once, before any process group."""
from __future__ import annotations

import pytest

from plugin.recipe.checks import check_recipe
from plugin.recipe.spec import Recipe

pytestmark = pytest.mark.nods

MODEL = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 32}


def _errors(parallelism, moe=None, model=True):
    data = {"name": "t", "batch": {"global": 8, "micro": 1}, "parallelism": parallelism}
    if model:
        data["model"] = {**MODEL, **({"moe": moe} if moe else {})}
    return {p.path: p for p in check_recipe(Recipe.from_dict(data)) if p.is_error}


def test_a_valid_expert_layout_passes_and_resolves():
    assert not _errors({"data": 4, "tensor": 2, "expert": 4}, {"experts": 8, "top_k": 2})
    recipe = Recipe.from_dict({"name": "t", "batch": {"global": 8, "micro": 1},
                               "parallelism": {"data": 2, "context": 2, "expert": 4},
                               "model": {**MODEL, "seq_len": 32, "moe": {"experts": 4}}})
    assert recipe.layout().expert == 4 and not [p for p in check_recipe(recipe) if p.is_error]


def test_experts_not_divisible_by_the_expert_degree():
    p = _errors({"data": 4, "expert": 4}, {"experts": 6})["$.parallelism.expert"]
    assert "experts 6 are not divisible by expert 4" in p.message and "1, 2, 3, 6" in p.hint


def test_expert_degree_must_divide_data_x_context():
    p = _errors({"data": 3, "context": 2, "expert": 4}, {"experts": 8})["$.parallelism.expert"]
    assert "does not divide data 3 x context 2 = 6" in p.message and "[1, 2, 3, 6]" in p.hint


def test_a_model_block_without_experts_is_a_warning_the_built_model_decides():
    """The reference GPT of a block without moe has no experts, but a transformers MoE family sized by the block
    (train.py --model mixtral) has: a warning here; initialize refuses a built model without experts
    (tests/unit/expert_parallel/test_reach.py)."""
    assert not _errors({"data": 2, "expert": 2})
    assert not _errors({"data": 2, "expert": 2}, model=False)  # a model given at initialize: checked there
    recipe = Recipe.from_dict({"name": "t", "batch": {"global": 8, "micro": 1}, "parallelism": {"data": 2, "expert": 2},
                               "model": {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 16}})
    (p,) = [p for p in check_recipe(recipe, 2) if p.path == "$.parallelism.expert"]
    assert not p.is_error and "the recipe's model has none" in p.message and "--model mixtral" in p.message
    assert '"moe"' in p.hint


def test_expert_tensor_top_k_every_and_ffn():
    errors = _errors({"data": 2, "tensor": 4, "expert": 2, "expert_tensor": 2},
                     {"experts": 4, "top_k": 5, "every": 3, "ffn_hidden": 7})
    assert {"$.parallelism.expert_tensor", "$.model.moe.top_k", "$.model.moe.every", "$.model.moe.ffn_hidden"} \
        <= set(errors)
    assert all(p.hint for p in errors.values())
