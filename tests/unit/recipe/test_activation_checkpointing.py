"""The recipe's ``activation_checkpointing`` block: defaults, the moved
``pipeline_parallel.activation_checkpoint_interval`` (an error naming the new path and the equivalent value), and the
cross-field warnings."""
from plugin.recipe.checks import check_recipe
from plugin.recipe.load import recipe_from_data
from plugin.recipe.spec import ActivationCheckpointing

BASE = {"name": "r", "parallelism": {"data": 1, "pipeline": 2}, "batch": {"micro": 2, "grad_accum": 2},
        "model": {"layers": 4, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 64}}


def _read(**extra):
    recipe, problems = recipe_from_data({**BASE, **extra})
    return recipe, problems


def test_the_default_is_no_recompute_and_full_spans_are_deepspeeds_interval():
    recipe, problems = _read()
    assert not problems and recipe.activation_checkpointing == ActivationCheckpointing("none", 1)
    assert recipe.activation_checkpointing.interval == 0
    assert ActivationCheckpointing("full", 3).interval == 3
    assert ActivationCheckpointing("selective").interval == 0  # the model recomputes its core, no layer spans
    recipe, _ = _read(activation_checkpointing={"mode": "full", "every": 2})
    assert recipe.to_dict()["activation_checkpointing"] == {"mode": "full", "every": 2}


def test_the_old_interval_is_refused_with_the_new_path_and_value():
    for interval, want in ((2, 'write "activation_checkpointing": {"mode": "full", "every": 2} at the top level'),
                           (0, 'drop this key (0 was off, the default: "activation_checkpointing": {"mode": "none"})'),
                           ("2", '{"mode": "full", "every": K}')):
        recipe, problems = _read(pipeline_parallel={"activation_checkpoint_interval": interval})
        errors = [p for p in problems if p.is_error]
        assert recipe is None and len(errors) == 1, problems
        assert errors[0].path == "$.pipeline_parallel.activation_checkpoint_interval"
        assert "moved to $.activation_checkpointing" in errors[0].message and want in errors[0].hint, errors[0]


def test_every_without_full_and_spans_longer_than_the_model_are_warned():
    recipe, _ = _read(activation_checkpointing={"mode": "selective", "every": 2})
    (warning,) = [p for p in check_recipe(recipe) if p.path == "$.activation_checkpointing.every"]
    assert not warning.is_error and '"mode": "full"' in warning.hint
    recipe, _ = _read(activation_checkpointing={"mode": "full", "every": 8})
    (warning,) = [p for p in check_recipe(recipe) if p.path == "$.activation_checkpointing.every"]
    assert not warning.is_error and "<= 4" in warning.hint
    recipe, _ = _read(activation_checkpointing={"mode": "full", "every": 4})
    assert not [p for p in check_recipe(recipe) if p.path.startswith("$.activation_checkpointing")]
