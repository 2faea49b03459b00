"""The batch triple and the data degree."""
import pytest

from plugin.errors import RecipeError
from plugin.layout import nearest_multiple, resolve_batch
from plugin.recipe import Batch, Recipe


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
    with pytest.raises(RecipeError, match="no data size fits 7"):
        _recipe(data=4, tensor=2).layout(7)


def test_grad_accum_alone_is_a_problem_not_a_crash():
    triple, problems = resolve_batch(Batch(grad_accum=8), 2)
    assert triple is None and problems[0].path == "$.batch" and '"micro"' in problems[0].hint
