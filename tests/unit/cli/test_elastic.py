"""``python -m plugin elastic`` and the pure rule under it (plugin.recipe.elastic), against sizes worked by hand."""
import json

import pytest

from plugin.recipe.elastic import elastic_problems, usable_world
from plugin.recipe.spec import Recipe

from .test_cli import cli

# tensor 2 x pipeline 2 = 4 ranks per replica; global 48 = micro 2 x grad_accum x data
RECIPE = {"name": "el", "parallelism": {"data": "auto", "tensor": 2, "pipeline": 2},
          "batch": {"global": 48, "micro": 2},
          "model": {"layers": 8, "hidden": 1024, "heads": 16, "vocab": 32000, "seq_len": 1024}}


def test_usable_world_is_the_largest_count_the_layout_and_the_global_batch_split():
    r = Recipe.from_dict(RECIPE)
    # data must divide 48 / 2 = 24 and the world must be 4 x data: data 1, 2, 3, 4, 6, 8, 12, 24
    by_hand = {3: None, 4: 4, 7: 4, 8: 8, 12: 12, 15: 12, 16: 16, 20: 16, 23: 16, 24: 24, 28: 24, 31: 24, 32: 32,
               47: 32, 48: 48, 95: 48, 96: 96, 200: 96}
    assert {w: usable_world(r, w) for w in by_hand} == by_hand


def test_an_elastic_recipe_needs_data_auto_and_a_global_batch_without_fixed_accumulation():
    fixed = Recipe.from_dict({**RECIPE, "parallelism": {"data": 2, "tensor": 2, "pipeline": 2},
                              "batch": {"micro": 2, "grad_accum": 6}})
    assert [p.path for p in elastic_problems(fixed)] == ["$.parallelism.data", "$.batch.global"]
    both = Recipe.from_dict({**RECIPE, "batch": {"global": 48, "grad_accum": 6}})
    assert [p.path for p in elastic_problems(both)] == ["$.batch.grad_accum"]
    assert elastic_problems(Recipe.from_dict(RECIPE)) == []


def test_the_command_lists_every_node_count_with_its_layout(tmp_path):
    path = tmp_path / "el.json"
    path.write_text(json.dumps(RECIPE))
    out = cli("elastic", path, "--nodes", "1:5", "--gpus-per-node", "4", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    got = [(r["nodes"], r["world_size"], r["usable"], r["layout"]["data"], r["layout"]["grad_accum"]) for r in rows]
    assert got == [(1, 4, 4, 1, 24), (2, 8, 8, 2, 12), (3, 12, 12, 3, 8), (4, 16, 16, 4, 6), (5, 20, 16, 4, 6)]
    assert all(r["memory_per_gpu"] > 0 and r["step_time_s"] > 0 for r in rows)
    assert [r["idle_nodes"] for r in rows] == [0, 0, 0, 0, 1]  # at 5 nodes ranks 16-19, the fifth node, train none
    text = cli("elastic", path, "--nodes", "5", "--gpus-per-node", "4")
    assert text.returncode == 0 and "16 (1 node idle)" in text.stdout, text.stdout
    caption = " ".join(text.stdout.split())
    assert "except the first of an idle node (none of its processes trains): it stands by" in caption
    three = cli("elastic", path, "--nodes", "5", "--gpus-per-node", "3", "--json")  # 15 processes: 12 train
    assert [(r["usable"], r["idle_nodes"]) for r in json.loads(three.stdout)] == [(12, 1)]  # ranks 12-14: node 4


def test_the_table_names_the_context_axis(tmp_path):
    path = tmp_path / "elc.json"  # tensor 2 x context 2: 4 processes a replica; global 48 = micro 2 x accum x data
    path.write_text(json.dumps({**RECIPE, "parallelism": {"data": "auto", "tensor": 2, "pipeline": 1, "context": 2}}))
    out = cli("elastic", path, "--nodes", "1:3", "--gpus-per-node", "6", "--json")
    rows = json.loads(out.stdout)
    assert [(r["usable"], r["layout"]["data"], r["layout"]["context"], r["idle_nodes"]) for r in rows] == \
        [(4, 1, 2, 0), (12, 3, 2, 0), (16, 4, 2, 0)]  # 6 -> 4 (2 idle), 12, 18 -> 16 (2 idle on the third node)
    text = cli("elastic", path, "--nodes", "2", "--gpus-per-node", "6")
    assert "data 3 x tensor 2 x pipeline 1 x context 2" in text.stdout, text.stdout


@pytest.mark.parametrize("nodes, code", [("1:2", 3), ("2:2", 0)])
def test_a_range_with_a_node_count_that_cannot_train_exits_3(tmp_path, nodes, code):
    path = tmp_path / "el.json"
    path.write_text(json.dumps(RECIPE))
    out = cli("elastic", path, "--nodes", nodes, "--gpus-per-node", "3")  # 3 processes: below one replica of 4
    assert out.returncode == code, out.stdout + out.stderr


def test_a_fixed_recipe_is_refused_with_the_fix():
    out = cli("elastic", "cpu_dp4", "--nodes", "1:2", "--gpus-per-node", "2")
    assert out.returncode == 2
    assert '$.parallelism.data: an elastic job changes its world size, but the recipe fixes data at 4 -> set "data": ' \
           '"auto"' in out.stderr
