"""The dry run in this process (no launch): every shipped recipe built and stepped on the meta device over the
recording process group, its checks passing; the command's JSON and exit codes; a fault named."""
import json
import subprocess
import sys

import pytest

from plugin.recipe.checks import load_recipe
from plugin.recipe.paths import recipes_dir

pytest.importorskip("torch")

SHIPPED = sorted(p.stem for p in recipes_dir().glob("*.json"))
WORLD = {"tp2_auto": 8}  # "data": "auto": the world it is run at


def _dry(name, ranks, tmp_path=None):
    """The dry run of shipped recipe ``name``; with ``tmp_path``, of the same layout with as few micro-batches per step
    as its pipeline takes (the time of a dry run grows with them; what they do is the same each time)."""
    from plugin.dryrun.run import dry_run

    recipe = load_recipe(name)
    if tmp_path is not None:
        text = json.loads((recipes_dir() / f"{name}.json").read_text())
        lay = recipe.layout(WORLD.get(name))
        text["batch"]["global"] = lay.micro_batch * lay.data * lay.pipeline
        if "grad_accum" in text["batch"]:
            text["batch"]["grad_accum"] = lay.pipeline
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(text))
        recipe = load_recipe(path)
    world = recipe.layout(WORLD.get(name)).world_size
    return dry_run(recipe, world_size=WORLD.get(name), ranks=ranks(world) if ranks else None)


def test_every_shipped_recipe_builds_and_steps_its_last_rank(tmp_path):
    """The last rank of each (with a rank of each earlier stage, whose shapes it takes), at as many micro-batches
    as its pipeline has stages: built, stepped (FSDP2's ZeRO-3 built only), no check failed, what it holds within a
    factor of the planner's estimate."""
    for name in SHIPPED:
        result = _dry(name, lambda world: [world - 1], tmp_path)
        failed = [c for c in result["checks"] if c["ok"] is False]
        assert not failed, (name, failed)
        last = result["ranks"][-1]
        assert last["parameters"] > 0 and last["bytes"]["parameters"] > 0, name
        fsdp = load_recipe(name).zero.stage == 3
        assert last["stepped"] is not fsdp, name
        if not fsdp:
            assert 0.3 < last["ratio"] < 3, (name, last["ratio"], last["bytes"], last["estimate"])
            assert result["world_size"] == 1 or any(c["op"] == "all_reduce" for c in last["collectives"]), name


@pytest.mark.slow
def test_every_shipped_recipe_default_ranks_all_checks_pass(tmp_path):
    """Replica 0 and the last rank of every shipped recipe (as few micro-batches as above): the replica's parameter
    count is checked too."""
    for name in SHIPPED:
        result = _dry(name, None, tmp_path)
        assert [c["ok"] for c in result["checks"] if c["name"] == "parameters"] == [True], name
        assert not [c for c in result["checks"] if c["ok"] is False], name


def test_the_command_prints_the_issue_schema_and_names_a_failed_check(tmp_path):
    """``--json`` has the issue's fields; a recipe whose ranks hold more than its GPUs' memory exits 2 naming
    them; ``--verify`` compares whole groups."""
    recipe = json.loads((recipes_dir() / "cpu_tp2_pp2.json").read_text())
    recipe["cluster"]["gpu_memory_gb"] = 0.0005  # 0.5 MB: stage 0 holds 0.94 MB
    path = tmp_path / "small_gpus.json"
    path.write_text(json.dumps(recipe))
    out = subprocess.run([sys.executable, "-m", "plugin", "dryrun", str(path), "--json", "--verify"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "check memory failed for ranks [0]" in out.stderr
    data = json.loads(out.stdout)
    rank = data["ranks"][0]
    assert {"rank", "coordinates", "groups", "parameters", "bytes", "estimate", "collectives"} <= set(rank)
    assert set(rank["collectives"][0]) >= {"op", "group", "bytes", "count"}
    assert rank["groups"]["tensor"] == "0,1" and rank["groups"]["pipeline"] == "0,2"
    assert {c["group"] for c in rank["collectives"]} >= {"tensor", "pipeline"}
    assert {c["name"]: c["ok"] for c in data["checks"]} == {"groups": True, "collectives": True, "pipeline": True,
                                                           "parameters": True, "memory": False}


def test_a_collective_one_rank_skips_is_named(monkeypatch):
    """The hang at step 1 of a large job, found before it: tensor rank 1 leaves out the gradient norm's all-reduce
    over the model group (a fault put in the clipping here); ``verify`` simulates every member, and the collectives
    check names the ranks that differ from their group."""
    import plugin.distributed.clipping as clipping
    from plugin.dryrun.run import dry_run

    norm = clipping.global_grad_norm

    def skipping(params, **kw):
        return norm(params, **{**kw, "model_size": 1}) if kw["tp_rank"] == 1 else norm(params, **kw)

    monkeypatch.setattr(clipping, "global_grad_norm", skipping)
    result = dry_run(load_recipe("cpu_tp2_pp2"), verify=True)
    check = next(c for c in result["checks"] if c["name"] == "collectives")
    assert check["ok"] is False and check["ranks"] == [1, 3], check
    assert "group 0-3" in check["detail"]


def test_a_pipeline_cut_the_model_cannot_take_is_named_with_its_rank(tmp_path):
    """The recipe passes ``validate`` (it cannot know the model's layer classes); the dry run builds the stage cut and
    names it, with the rank (``python -m plugin dryrun`` then exits 2, as for a failed check)."""
    from plugin.dryrun.run import dry_run
    from plugin.errors import PluginError

    recipe = json.loads((recipes_dir() / "cpu_tp2_pp2.json").read_text())
    recipe["pipeline_parallel"]["partition"] = "type:NoSuchBlock"
    path = tmp_path / "bad_cut.json"
    path.write_text(json.dumps(recipe))
    with pytest.raises(PluginError, match=r'rank 0 \(pipeline 0, data 0, context 0, tensor 0\): partition '
                       r'"type:NoSuchBlock" matches none of the layer classes'):
        dry_run(load_recipe(path), ranks=[2])


def test_an_expert_axis_is_simulated_under_a_uniform_routing_and_a_bad_expert_count_named(tmp_path):
    """Meta tensors hold no router scores: a uniform routing stands in (it once died in aten::bincount on meta, then
    was refused). The expert groups and their all-to-alls are reported under the axis names, each rank's experts count
    for its expert group's, and the checks pass; experts that do not divide over the expert degree are named before
    any rank is built (the command exits 2)."""
    from plugin.dryrun.run import dry_run

    recipe = json.loads((recipes_dir() / "cpu_dp4.json").read_text())
    recipe["parallelism"]["expert"], recipe["zero"] = 2, {"stage": 1}
    recipe["model"]["moe"] = {"experts": 4, "top_k": 2, "every": 2}
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(recipe))
    result = dry_run(load_recipe(path))
    assert all(c["ok"] for c in result["checks"]), result["checks"]
    rank0 = result["ranks"][0]
    assert rank0["coordinates"]["expert"] == 0 and rank0["groups"]["expert"] == "0,1", rank0["groups"]
    ops = {(c["op"], c["group"]) for c in rank0["collectives"]}
    # the tokens there and back, the experts' gradients and their ZeRO-1 partition's broadcast over expert-data
    assert {("all_to_all", "expert"), ("all_reduce", "expert_data"), ("broadcast", "expert_data")} <= ops, ops
    assert rank0["expert_parameters"] > 0 and rank0["bytes"]["optimizer_states"] > 0
    recipe["model"]["moe"]["experts"] = 3
    path.write_text(json.dumps(recipe))
    run = subprocess.run([sys.executable, "-m", "plugin", "dryrun", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and "experts 3 are not divisible by expert 2" in run.stderr + run.stdout, run


def test_an_interleaved_schedule_whose_stages_wait_on_each_other_is_simulated(tmp_path):
    """Interleaved 1F1B: rank 0's virtual stage 2 takes its input shapes from rank 1's stage 1, whose stage 3 takes
    them from rank 0's stage 2. Each rank is simulated again once the others sent their shapes; it once stopped with
    a traceback (MissingStage) on a recipe ``validate`` accepts."""
    from plugin.dryrun.run import dry_run

    recipe = json.loads((recipes_dir() / "cpu_tp2_pp2.json").read_text())
    recipe["parallelism"] = {"data": 1, "tensor": 1, "pipeline": 2}
    recipe["pipeline_parallel"] = {"schedule": "interleaved_1f1b", "virtual_stages": 2, "partition": "uniform"}
    recipe["model"]["layers"] = 4
    recipe["batch"] = {"global": 4, "micro": 2}
    path = tmp_path / "interleaved.json"
    path.write_text(json.dumps(recipe))
    result = dry_run(load_recipe(path))
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    assert all(c["ok"] for c in result["checks"]), result["checks"]
    (pipeline,) = [c for c in result["checks"] if c["name"] == "pipeline"]
    assert "each with its receive" in pipeline["detail"], pipeline
