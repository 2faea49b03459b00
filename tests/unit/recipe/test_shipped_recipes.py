"""The shipped recipes validate, carry "$schema", and the schema agrees with the dataclasses."""
import dataclasses
import json
import typing

import pytest

from plugin.recipe import spec as recipe_mod
from plugin.recipe.checks import validate
from plugin.recipe.load import shipped_recipes
from plugin.recipe.schema import load_schema
from plugin.recipe.spec import Recipe, json_key

SHIPPED = shipped_recipes()
EIGHT_GPU = ["dp8_zero1", "dp8_zero2", "dp8_zero3", "dp8_zero3_offload", "tp2_dp4", "tp4_dp2", "tp8", "pp2_dp4",
             "pp4_dp2", "tp2_pp2_dp2", "tp2_sp_dp4"]
CPU = ["cpu_single", "cpu_dp4", "cpu_zero3_dp4", "cpu_tp2_dp2", "cpu_pp2_dp2", "cpu_tp2_pp2", "cpu_tp2_sp_pp2"]


def test_the_issue_list_is_shipped():
    names = {p.stem for p in SHIPPED}
    assert set(EIGHT_GPU + CPU + ["tp2_auto"]) <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_validates_without_warnings(path):
    world = 8 if path.stem == "tp2_auto" else None
    recipe, problems = validate(path, world)
    assert recipe is not None, [p.format() for p in problems]
    assert problems == [], [p.format() for p in problems]
    raw = json.loads(path.read_text())
    assert raw["$schema"] == "../schemas/recipe.schema.json"
    assert recipe.name == path.stem


@pytest.mark.parametrize("name", EIGHT_GPU)
def test_eight_gpu_recipes_fill_eight(name):
    assert validate(name)[0].layout().world_size == 8


def test_cpu_recipes_share_model_and_global_batch():
    recipes = [validate(n)[0] for n in CPU]
    assert {r.model for r in recipes} == {recipes[0].model}
    assert {r.layout().global_batch for r in recipes} == {16}
    assert all(r.model.dropout == 0 for r in recipes)
    assert {r.layout().world_size for r in recipes} == {1, 4}


def _dataclass_of(cls, field):
    hint = typing.get_type_hints(cls)[field.name]
    return recipe_mod._target_class(hint)


def _walk(cls, schema, where="$"):
    """Every dataclass field has a schema property under its JSON key, and defaults agree."""
    props = schema["properties"]
    keys = {json_key(f): f for f in dataclasses.fields(cls) if json_key(f) is not None}
    assert set(keys) == set(props), f"{where}: dataclass keys {sorted(keys)} != schema keys {sorted(props)}"
    for key, f in keys.items():
        sub = props[key]
        assert sub.get("description"), f"{where}.{key} has no description"
        if key != "$schema":
            assert sub.get("examples"), f"{where}.{key} has no examples"
        plain_default = f.default not in (dataclasses.MISSING, None) and not dataclasses.is_dataclass(f.default)
        if "default" in sub and plain_default:
            default = list(f.default) if isinstance(f.default, tuple) else f.default
            assert default == sub["default"], f"{where}.{key}: dataclass {f.default!r} != schema {sub['default']!r}"
        inner = _dataclass_of(cls, f)
        if inner is not None:
            assert sub.get("additionalProperties") is False, f"{where}.{key} accepts unknown keys"
            _walk(inner, sub, f"{where}.{key}")
            if "default" in sub:
                assert recipe_mod._unbuild(inner()) == sub["default"], f"{where}.{key}: default object differs"


def test_schema_matches_dataclasses():
    schema = load_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["additionalProperties"] is False
    _walk(Recipe, schema)


def test_schema_is_a_valid_draft_2020_12_schema():
    import jsonschema

    jsonschema.Draft202012Validator.check_schema(load_schema())


def test_round_trip_through_dict():
    for path in SHIPPED:
        r = validate(path, 8 if path.stem == "tp2_auto" else None)[0]
        again = Recipe.from_dict(r.to_dict())
        assert again == r


def test_every_optional_field_has_a_default_or_says_why_not():
    def walk(node, where):
        for key, sub in node.get("properties", {}).items():
            if key not in node.get("required", []) and "default" not in sub:
                assert "No \"default" in sub.get("$comment", ""), f"{where}.{key}: no default and no reason given"
            walk(sub, f"{where}.{key}")

    walk(load_schema(), "$")
    model = load_schema()["properties"]["model"]["properties"]
    assert "Absent: equal to heads" in model["kv_heads"]["description"]
    assert "Absent: 4 x hidden" in model["ffn_hidden"]["description"]
