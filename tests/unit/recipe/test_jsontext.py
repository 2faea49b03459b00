"""Recipe text that Python's json module reads but JSON does not allow, or cannot read at all."""
from plugin.recipe.jsontext import INVALID, parse_json


def _texts(problems):
    return [f"{p.path}: {p.message}" for p in problems]


def test_an_integer_past_pythons_digit_cap_is_a_problem_with_its_position():
    value, problems = parse_json('{"batch":\n  {"micro": ' + "1" * 5000 + "}}", "r.json")
    assert value is INVALID
    assert _texts(problems) == ["$: invalid number at line 2, column 13: 111111111111... has more than 4300 digits"]


def test_a_long_integer_is_not_mistaken_for_an_overflowing_float():
    """json reads integers with int(): 400 digits are a (huge) integer, not infinity; the NaN after it keeps
    its own line and column."""
    value, problems = parse_json('{"micro": ' + "1" * 400 + ', "lr": NaN}')
    assert value is INVALID
    assert _texts(problems) == [f"$.lr: invalid JSON at line 1, column {10 + 400 + 9}: NaN is not a finite number "
                                "(JSON has no NaN or Infinity)"]
    value, problems = parse_json('{"micro": ' + "1" * 400 + "}")
    assert problems == [] and value == {"micro": int("1" * 400)}


def test_overflowing_floats_and_repeated_keys_are_all_reported_together():
    value, problems = parse_json('{"lr": 1e999, "zero": {"stage": 1, "stage": 2}}')
    assert value is INVALID
    assert _texts(problems) == [
        "$.lr: invalid JSON at line 1, column 8: 1e999 is not a finite number (it is too large for a float)",
        '$.zero: key "stage" appears more than once in this object (JSON keeps only the last, 2)']


def test_nan_in_data_built_in_python_is_named_at_its_path():
    """Recipe.from_dict / recipe_from_data never see text: the schema step names NaN and infinities itself."""
    from plugin.recipe.checks import load_recipe
    from plugin.recipe.load import recipe_from_data

    data = load_recipe("cpu_dp4").to_dict()
    data["optimizer"] = {**data["optimizer"], "lr": float("nan"), "betas": [0.9, float("inf")]}
    recipe, problems = recipe_from_data(data, "r.json")
    assert recipe is None
    assert [p.path for p in problems if "not a finite number" in p.message] == ["$.optimizer.lr",
                                                                                  "$.optimizer.betas[1]"]
