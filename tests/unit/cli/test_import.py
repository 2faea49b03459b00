"""``python -m plugin import`` as a user runs it: a DeepSpeed config or an Accelerate YAML in, a recipe validate
accepts out (export -> import -> validate), and one line for the file it cannot use."""
import json

import pytest

from plugin.recipe.checks import check_recipe, load_recipe
from plugin.recipe.spec import Recipe

from .test_cli import cli


def _context_recipe(tmp_path, method="ring"):
    data = load_recipe("cpu_tp2_dp2").to_dict()
    data.update(name="ctx", parallelism={"data": 2, "tensor": 1, "pipeline": 1, "context": 2},
                context_parallel={"method": method})
    path = tmp_path / "ctx.json"
    path.write_text(json.dumps(data))
    return path


def _deepspeed_takes_context(path) -> bool:
    """Whether the recipe checks let the DeepSpeed back end train a context axis (they refuse it today)."""
    recipe = Recipe.from_dict({**json.loads(path.read_text()), "launcher": "deepspeed"})
    return not [p for p in check_recipe(recipe, 4) if p.is_error and p.path == "$.launcher"]


@pytest.mark.parametrize("to", ["deepspeed", "accelerate"])
def test_an_exported_context_recipe_imports_as_one_validate_accepts(tmp_path, to):
    """A context axis through either export and back: the layout kept, and a launcher that trains it (where the
    DeepSpeed back end refuses a context axis, a DeepSpeed config's recipe gets "auto", said in a warning)."""
    recipe = _context_recipe(tmp_path)
    exported = tmp_path / ("ctx.ds.json" if to == "deepspeed" else "ctx.yaml")
    assert cli("export", recipe, "--to", to, "-o", exported).returncode == 0
    back = tmp_path / "back.json"
    out = cli("import", exported, "--world-size", "4", "-o", back)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    launcher = to if to == "accelerate" or _deepspeed_takes_context(recipe) else "auto"
    assert json.loads(back.read_text())["launcher"] == launcher
    if launcher == "auto":
        said = '$.launcher: warning: "auto" written, not "deepspeed", which refuses this recipe (context 2'
        assert said in out.stderr, out.stderr
    out = cli("validate", back)
    assert out.returncode == 0 and "data 2 x tensor 1 x pipeline 1 x context 2 = 4 processes; batch 16" in out.stdout


def test_an_accelerate_yaml_round_trips_through_import_and_export(tmp_path):
    yaml = tmp_path / "acc.yaml"
    assert cli("export", "cpu_tp2_pp2", "--to", "accelerate", "--cpu", "-o", yaml).returncode == 0
    out = cli("import", yaml)  # to stdout
    assert out.returncode == 0, out.stderr
    recipe = json.loads(out.stdout)
    assert recipe["parallelism"] == {"data": 1, "tensor": 2, "pipeline": 2} and recipe["launcher"] == "accelerate"
    back = tmp_path / "back.json"
    back.write_text(out.stdout)
    again = cli("export", back, "--to", "accelerate", "--cpu")
    assert again.stdout.splitlines()[1:] == yaml.read_text().splitlines()[1:]  # all but the name in the first line


@pytest.mark.parametrize("name", ["empty.json", "empty.yaml"])
def test_an_empty_file_is_said_to_be_empty(tmp_path, name):
    path = tmp_path / name
    path.write_text("\n")
    out = cli("import", path)
    assert out.returncode == 2 and out.stdout == "" and out.stderr.strip() == (
        f"{path}: $: the file is empty -> give a DeepSpeed config (JSON) or an Accelerate config (YAML)")


def test_what_import_cannot_use_is_one_line(tmp_path):
    out = cli("import", "recipes/cpu_dp4.json")
    assert out.returncode == 2 and out.stderr.strip() == ("recipes/cpu_dp4.json: $: this is a recipe already (it has "
                                                          "parallelism) -> check it with: python -m plugin validate "
                                                          "recipes/cpu_dp4.json")
    other = tmp_path / "other.yaml"
    other.write_text("name: a workflow\non: push\n")
    out = cli("import", other)
    assert out.returncode == 2 and "YAML, but not an Accelerate config (no distributed_type)" in out.stderr
