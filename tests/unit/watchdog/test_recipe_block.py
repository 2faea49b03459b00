"""The recipe's ``watchdog`` block: default, schema, the check for recipes built in Python, show's words."""
import json

from plugin.recipe.checks import check_recipe
from plugin.recipe.load import recipe_from_data
from plugin.recipe.spec import Recipe, Watchdog


def _recipe(**more):
    data = {"name": "w", "parallelism": {"data": 2}, "batch": {"global": 8, "micro": 4}, **more}
    return recipe_from_data(data, "w.json")


def test_default_and_round_trip():
    recipe, problems = _recipe()
    assert not [p for p in problems if p.is_error]
    assert recipe.watchdog == Watchdog(600) and recipe.watchdog.preflight_s == 60
    recipe, _ = _recipe(watchdog={"timeout_s": 20})
    assert recipe.watchdog.timeout_s == 20 and recipe.watchdog.preflight_s == 20
    assert Recipe.from_dict(recipe.to_dict()) == recipe


def test_schema_and_checks_refuse_what_cannot_guard():
    recipe, problems = _recipe(watchdog={"timeout_s": 4})
    assert recipe is None and [p.path for p in problems if p.is_error] == ["$.watchdog.timeout_s"]
    recipe, problems = _recipe(watchdog={"timeout": 30})
    assert recipe is None and any('did you mean "timeout_s"' in p.format() for p in problems)
    recipe, _ = _recipe()
    bad = Recipe.from_dict({**recipe.to_dict(), "watchdog": {"timeout_s": 3}})  # built in Python: no schema
    errors = [p for p in check_recipe(bad, 2) if p.is_error]
    assert [p.path for p in errors] == ["$.watchdog.timeout_s"] and "at least 5" in errors[0].message, errors
    assert errors[0].hint


def test_show_says_the_limits(capsys):
    from plugin.cli.main import main

    assert main(["show", "cpu_tp2_dp2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["resolved"]["watchdog"] == "timeout 600 s, pre-flight 60 s per group"
