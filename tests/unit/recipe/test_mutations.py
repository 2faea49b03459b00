"""Hypothesis: mutated recipes and corrupted recipe text are reported as problems, never raised, and a recipe that
passed its checks goes through every pure layer (layout, topology, DeepSpeed and Accelerate exports) without an
exception: a RecipeError there would be a rule the checks missed."""
import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plugin.distributed.topology import Topology
from plugin.errors import RecipeError
from plugin.interop.accelerate_config import to_accelerate_config
from plugin.interop.deepspeed_config import to_ds_config
from plugin.recipe.checks import check_recipe
from plugin.recipe.load import recipe_from_data, recipe_from_text, shipped_recipes

BASES = [json.loads(p.read_text()) for p in shipped_recipes()]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 70000) | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.integers(-5, 70000).map(float)  # integral floats: JSON Schema counts 2.0 as an integer
    | st.sampled_from(["auto", "none", "cpu", "nvme", "1f1b", "gpipe", "interleaved_1f1b", "uniform", "type:Block",
                       "type:(", "column", "row", "vocab", "bf16", "fp16", "adam", "sgd", "deepspeed", ""])
    | st.text(max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=6,
)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))


def _at(data, path):
    for k in path:
        data = data[k]
    return data


@st.composite
def mutated(draw):
    data = copy.deepcopy(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["set", "delete", "add", "float"]))
        paths = [p for p in _paths(data) if p]
        if action == "float":  # the same whole number written as 2.0: valid JSON, and JSON Schema calls it an integer
            paths = [p for p in paths if type(_at(data, p)) is int] or paths
        path = draw(st.sampled_from(paths))
        parent = _at(data, path[:-1])
        if action == "float" and type(parent[path[-1]]) is int:
            parent[path[-1]] = float(parent[path[-1]])
        elif action == "delete":
            parent.pop(path[-1], None)
        elif action == "add":
            parent[draw(st.text(min_size=1, max_size=8))] = draw(json_values)
        else:
            parent[path[-1]] = draw(json_values)
        if not isinstance(data, dict):
            break
    return data


def _exercise(recipe, world_size):
    problems = check_recipe(recipe, world_size)
    for p in problems:
        assert p.path.startswith("$") and p.message, p
    if any(p.is_error for p in problems):
        return
    if recipe.parallelism.data == "auto" and world_size is None:  # nothing resolves before a world is launched
        with pytest.raises(RecipeError, match="data"):
            recipe.layout(world_size)
        return
    lay = recipe.layout(world_size)  # the checks passed: from here on nothing may raise
    Topology(lay.pipeline, lay.data, lay.tensor)
    to_ds_config(recipe, world_size)
    to_accelerate_config(recipe, world_size)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated(), st.one_of(st.none(), st.integers(1, 64)))
def test_mutated_recipes_are_reported_and_what_passes_exports(data, world_size):
    recipe, problems = recipe_from_data(data)
    assert (recipe is None) == any(p.is_error for p in problems)
    for p in problems:
        assert p.path.startswith("$") and p.message
    if recipe is not None:
        _exercise(recipe, world_size)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(BASES), st.integers(0, 2000), st.text(max_size=3))
def test_corrupted_text_is_reported_not_raised(base, position, junk):
    text = json.dumps(base, indent=2)
    position = position % (len(text) + 1)
    corrupted = text[:position] + junk + text[position:]
    recipe, problems = recipe_from_text(corrupted, "x.json")
    assert (recipe is None) == any(p.is_error for p in problems)
    for p in problems:
        assert p.file == "x.json" and p.path.startswith("$") and p.message, p
    try:
        parsed = json.loads(corrupted)
    except json.JSONDecodeError as e:  # not JSON: refused, at the place json names
        assert recipe is None and any(f"line {e.lineno}, column {e.colno}" in p.message for p in problems), problems
        return
    if parsed == base:  # the junk changed no value (whitespace between tokens): the same recipe
        assert recipe is not None and recipe == recipe_from_data(base, "x.json")[0], problems
