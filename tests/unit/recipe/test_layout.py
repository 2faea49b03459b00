"""The batch triple and the data degree."""
import pytest

from plugin.errors import RecipeError
from plugin.recipe.layout import (
    batch_problems_for_any_data,
    known_grad_accum,
    nearest_multiple,
    resolve_batch,
    resolve_layout,
)
from plugin.recipe.spec import Batch, Recipe


@pytest.mark.parametrize("batch,data,triple", [
    (Batch(global_=64, micro=4), 4, (64, 4, 4)),
    (Batch(micro=4, grad_accum=8), 4, (128, 4, 8)),
    (Batch(global_=64, grad_accum=2), 4, (64, 8, 2)),
    (Batch(global_=64, micro=4, grad_accum=4), 4, (64, 4, 4)),
    (Batch(micro=4), 8, (32, 4, 1)),
    (Batch(global_=32), 8, (32, 4, 1)),
])
def test_triples(batch, data, triple):
    assert resolve_batch(batch, data)[0] == triple


@pytest.mark.parametrize("batch,data,hint", [
    (Batch(global_=60, micro=4), 4, "set global to 64"),
    (Batch(global_=66, micro=4), 4, "set global to 64"),
    (Batch(global_=72, micro=4), 4, "set global to 80"),  # a tie goes up
    (Batch(global_=8, micro=4), 4, "set global to 16"),
    (Batch(global_=30, grad_accum=4), 2, "set global to 32"),
    (Batch(global_=64, micro=4, grad_accum=2), 4, "set global to 32"),
])
def test_bad_triples_suggest_the_nearest_valid_global_batch(batch, data, hint):
    triple, problems = resolve_batch(batch, data)
    assert triple is None and hint in problems[0].hint and problems[0].path == "$.batch.global"


def test_nearest_multiple():
    assert [nearest_multiple(v, 8) for v in (1, 4, 5, 8, 11, 12, 13)] == [8, 8, 8, 8, 8, 16, 16]


def _recipe(**par):
    return Recipe.from_dict({"name": "r", "parallelism": par, "batch": {"micro": 2}})


def test_auto_data_fills_the_world():
    lay = _recipe(data="auto", tensor=2, pipeline=2).layout(16)
    assert (lay.data, lay.world_size, lay.global_batch) == (4, 16, 8)


def test_auto_needs_a_world_size():
    with pytest.raises(RecipeError, match="needs the world size"):
        _recipe(data="auto", tensor=2).layout()


def test_world_size_mismatch_suggests_both_fixes():
    with pytest.raises(RecipeError) as e:
        _recipe(data=4, tensor=2).layout(12)
    (p,) = e.value.errors
    assert "launch 8 processes" in p.hint and '"data": 6' in p.hint
    with pytest.raises(RecipeError) as e:
        _recipe(data=4, tensor=2, pipeline=3).layout(7)
    (p,) = e.value.errors
    assert p.message == "data 4 x tensor 2 x pipeline 3 = 24 processes, but the launcher runs 7"
    assert p.hint == ('launch 24 processes; 7 cannot be split into tensor 2 x pipeline 3 groups (6 does not divide '
                      '7): launch 6 or 12 with "data": "auto", or choose tensor and pipeline whose product divides 7')
    with pytest.raises(RecipeError) as e:
        _recipe(data=1).layout(2)
    assert "= 1 process, but" in e.value.errors[0].message and "launch 1 process," in e.value.errors[0].hint


def test_grad_accum_alone_is_a_problem_not_a_crash():
    triple, problems = resolve_batch(Batch(grad_accum=8), 2)
    assert triple is None and problems[0].path == "$.batch" and '"micro"' in problems[0].hint


def test_a_world_mismatch_still_checks_the_batch_triple():
    r = Recipe.from_dict({"name": "r", "parallelism": {"data": 4, "tensor": 2}, "batch": {"global": 30, "micro": 4}})
    with pytest.raises(RecipeError) as e:
        r.layout(12)
    paths = [p.path for p in e.value.errors]
    assert paths == ["$.parallelism", "$.batch.global"]  # the same batch error as without --world-size
    assert [p.path for p in resolve_layout(r)[1]] == ["$.batch.global"]
    # and the other way out (data 6) says what the batch must become there
    assert '"data": 6' in e.value.errors[0].hint and "set global to 24" in e.value.errors[0].hint


@pytest.mark.parametrize("batch,path", [
    (Batch(global_=10, micro=4, grad_accum=2), "$.batch.global"),  # 10 is no multiple of 8
    (Batch(global_=10, micro=4), "$.batch.global"),
    (Batch(global_=10, grad_accum=4), "$.batch.global"),
    (Batch(grad_accum=4), "$.batch"),
    (Batch(global_=16, micro=4, grad_accum=2), None),  # data 2
    (Batch(global_=12, micro=4), None),  # data 3 or 1
])
def test_batch_problems_no_data_size_can_fix(batch, path):
    problems = batch_problems_for_any_data(batch)
    assert [p.path for p in problems] == ([path] if path else [])
    if path == "$.batch.global":
        for data in range(1, 65):  # really no data size resolves it
            assert resolve_batch(batch, data)[0] is None


def test_known_grad_accum():
    assert [known_grad_accum(b) for b in (Batch(grad_accum=3, micro=1), Batch(micro=4), Batch(global_=8),
                                          Batch(global_=8, micro=2))] == [3, 1, 1, None]
    # the recipe's own numeric data size fixes global / (micro x data), whatever world is launched
    assert [known_grad_accum(Batch(global_=8, micro=2), data) for data in (2, 3, "auto", None)] == [2, None, None, None]


def test_a_world_mismatch_keeps_the_pipeline_rules_the_recipes_data_size_decides():
    """pipeline 2 x data 2 with global 8 at micro 4 is one micro-batch per step, whatever world is launched:
    said beside the world-size error, not only once the world is fixed."""
    from plugin.recipe.checks import check_recipe
    from plugin.recipe.spec import Recipe

    recipe = Recipe.from_dict({"name": "r", "parallelism": {"data": 2, "tensor": 1, "pipeline": 2},
                               "zero": {"stage": 1}, "batch": {"global": 8, "micro": 4}})
    paths = {p.path for p in check_recipe(recipe, 6) if p.is_error}
    assert {"$.parallelism", "$.batch"} <= paths, paths


def test_auto_recipes_get_the_pipeline_rules_before_the_world_size_is_known():
    from plugin.recipe.checks import check_recipe

    def problems(**batch):
        r = Recipe.from_dict({"name": "r", "parallelism": {"data": "auto", "pipeline": 4}, "batch": batch})
        return [(p.path, p.severity) for p in check_recipe(r)]

    assert problems(micro=1, grad_accum=2) == [("$.batch", "error")]
    assert problems(micro=1, grad_accum=8) == [("$.batch.grad_accum", "warning")]  # bubble 3/8
    assert problems(micro=1, grad_accum=16) == []
    assert problems(**{"global": 64, "micro": 1}) == []  # grad_accum depends on the data size: nothing certain yet
