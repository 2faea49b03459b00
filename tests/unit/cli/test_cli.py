"""``python -m plugin``: exit codes, output shapes, and no torch/deepspeed/accelerate on these paths."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
INVALID = ROOT / "tests" / "data" / "invalid"


def cli(*args, check_imports=True):
    cmd = [sys.executable] + (["-X", "importtime"] if check_imports else []) + ["-m", "plugin", *map(str, args)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env={**os.environ, "COLUMNS": "160"})
    if check_imports:
        heavy = [line for line in out.stderr.splitlines() if line.startswith("import time:")
                 and line.split("|")[-1].strip() in ("torch", "deepspeed", "accelerate")]
        assert not heavy, f"{args[0]} imported {heavy}"
        out.stderr = "\n".join(line for line in out.stderr.splitlines() if not line.startswith("import time:"))
    return out


def test_validate_all_shipped_recipes():
    names = [p.stem for p in (ROOT / "recipes").glob("*.json")]
    out = cli("validate", *[n for n in names if n != "tp2_auto"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("ok: ") == len(names) - 1
    assert out.stderr == ""


def test_validate_reports_all_problems_of_all_files_and_exits_2():
    out = cli("validate", "cpu_dp4", INVALID / "zero3_with_pipeline.json", INVALID / "unknown_zero_key.json")
    assert out.returncode == 2
    assert "ok: cpu_dp4" in out.stdout
    lines = out.stderr.splitlines()
    assert any("zero3_with_pipeline.json: $.zero.stage: ZeRO stage 3 with pipeline 2" in line for line in lines)
    assert any('unknown_zero_key.json: $.zero.stgae: unknown key "stgae" -> did you mean "stage"?' in line
               for line in lines)


def test_many_errors_at_once(tmp_path):
    bad = json.loads((ROOT / "recipes" / "cpu_tp2_dp2.json").read_text())
    bad["name"] = "bad"
    bad["parallelism"] = {"data": 2, "tensor": 2, "pipeline": 2}
    bad["zero"] = {"stage": 3, "offload_param": "nvme"}
    bad["batch"] = {"global": 30, "micro": 4}
    bad["model"]["heads"] = 3
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    out = cli("validate", path, "--world-size", "8")
    assert out.returncode == 2
    paths = [line.split(": ")[1] for line in out.stderr.splitlines()]
    assert {"$.zero.stage", "$.zero.nvme_path", "$.batch.global", "$.model.heads"} <= set(paths), out.stderr


def test_world_size_flag_and_warnings_exit_0():
    out = cli("validate", "tp2_auto", "--world-size", "6")
    assert out.returncode == 0 and "warning:" in out.stderr and "data 3 x tensor 2" in out.stdout
    out = cli("validate", "tp2_dp4", "--world-size", "16")
    assert out.returncode == 2 and 'set "data": 8' in out.stderr


def test_usage_errors_exit_1():
    assert cli("validate").returncode == 1
    assert cli("validate", "cpu_dp4", "--world-size", "zero").returncode == 1
    assert cli("frobnicate").returncode == 1


def test_validate_json():
    out = cli("validate", "cpu_dp4", INVALID / "zero_stage_4.json", "--json")
    assert out.returncode == 2
    report = json.loads(out.stdout)
    assert [r["valid"] for r in report] == [True, False]
    assert report[1]["errors"][0]["path"] == "$.zero.stage"


def test_show_json_rank_map():
    out = cli("show", "tp2_pp2_dp2", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["resolved"]["world_size"] == 8 and data["resolved"]["grad_accum"] == 32
    r5 = data["ranks"][5]
    assert (r5["pipeline"], r5["data"], r5["tensor"], r5["node"]) == (1, 0, 1, 0)
    assert r5["tensor_peers"] == [4, 5] and r5["data_peers"] == [5, 7] and r5["pipeline_peers"] == [1, 5]


def test_show_table_groups_by_node(tmp_path):
    recipe = json.loads((ROOT / "recipes" / "tp2_auto.json").read_text())
    recipe["name"] = "two_nodes"
    recipe["cluster"] = {"nodes": 2, "gpus_per_node": 4, "gpu_memory_gb": 80}
    path = tmp_path / "two_nodes.json"
    path.write_text(json.dumps(recipe))
    out = cli("show", path, "--world-size", "8")
    assert out.returncode == 0, out.stderr
    assert "rank map" in out.stdout and "tensor peers" in out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith("│")]
    nodes = [line.split("│")[1].strip() for line in rows if line.split("│")[1].strip().isdigit() and "rank" not in line]
    assert nodes[-8:] == ["0"] * 4 + ["1"] * 4
    assert any(set(line.strip()) <= set("├┼─┤") and line.strip() for line in out.stdout.splitlines()[-6:-3]), \
        "a section line separates the nodes"
    assert cli("show", "tp2_auto").returncode == 2, "auto needs a world size"


def test_export_deepspeed_and_accelerate(tmp_path):
    out = cli("export", "tp2_dp4", "--to", "deepspeed")
    assert out.returncode == 0 and json.loads(out.stdout)["train_batch_size"] == 256
    target = tmp_path / "acc.yaml"
    out = cli("export", "cpu_dp4", "--to", "accelerate", "--cpu", "-o", target)
    assert out.returncode == 0 and "distributed_type: \"MULTI_CPU\"" in target.read_text()
    assert cli("export", INVALID / "zero_stage_4.json", "--to", "deepspeed").returncode == 2
    text = target.read_text()
    assert "# ZeRO-1 on CPU" in text and "without deepspeed" not in text, "deepspeed is allowed here"
    for flag in ("--cpu", "--no-deepspeed"):  # accelerate-only flags are refused with --to deepspeed
        out = cli("export", "cpu_dp4", "--to", "deepspeed", flag)
        assert out.returncode == 1 and f"{flag} shapes an Accelerate config only" in out.stderr


def test_import_round_trip(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(cli("export", "dp8_zero3_offload", "--to", "deepspeed").stdout)
    recipe_path = tmp_path / "mine.json"
    out = cli("import", ds, "--world-size", "8", "-o", recipe_path)
    assert out.returncode == 0, out.stderr
    again = cli("export", recipe_path, "--to", "deepspeed")
    assert json.loads(again.stdout) == json.loads(ds.read_text())
    assert json.loads(recipe_path.read_text())["name"] == "mine"


def test_import_bad_json(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_batch_size": 8,,}')
    out = cli("import", ds)
    assert out.returncode == 2 and "line 1, column 24" in out.stderr


def test_unknown_recipe_name_suggests_one():
    out = cli("validate", "tp2dp4")
    assert out.returncode == 2 and "did you mean tp2_dp4" in out.stderr


def _no_traceback(out):
    assert "Traceback" not in out.stderr, out.stderr


def test_auto_recipe_without_world_size_is_a_problem_not_a_traceback():
    for args in (("export", "tp2_auto", "--to", "deepspeed"), ("export", "tp2_auto", "--to", "accelerate"),
                 ("show", "tp2_auto")):
        out = cli(*args)
        _no_traceback(out)
        assert out.returncode == 2, (args, out.stderr)
        (line,) = out.stderr.splitlines()
        assert line.startswith(str(ROOT / "recipes" / "tp2_auto.json") + ": $.parallelism.data: ") and \
            "-> pass --world-size N" in line, line
    out = cli("export", "tp2_auto", "--to", "deepspeed", "--world-size", "8")
    assert out.returncode == 0 and json.loads(out.stdout)["train_batch_size"] == 128


def test_a_recipe_error_escaping_a_command_is_printed_not_raised(capsys):
    import argparse

    from plugin.cli.common import run_command
    from plugin.errors import Problem, RecipeError

    def run(args):
        raise RecipeError([Problem("$.x", "broken", "fix it", file="r.json")])

    assert run_command(argparse.Namespace(run=run)) == 2
    assert capsys.readouterr().err == "r.json: $.x: broken -> fix it\n"


def test_main_prints_a_recipe_error_a_command_lets_escape(capsys, monkeypatch):
    """``python -m plugin``'s main runs every command through run_command: no traceback, exit 2."""
    import plugin.cli.main as entry
    import plugin.cli.validate
    from plugin.errors import Problem, RecipeError

    def run(args):
        raise RecipeError([Problem("$.x", "m", "h", file="f")])

    monkeypatch.setattr(plugin.cli.validate, "run", run)
    assert entry.main(["validate", "x"]) == 2
    assert capsys.readouterr().err == "f: $.x: m -> h\n"


def test_integral_floats_are_rejected_by_every_command():
    path = INVALID / "integral_floats.json"
    for args in (("validate", path), ("show", path), ("export", path, "--to", "deepspeed")):
        out = cli(*args)
        _no_traceback(out)
        assert out.returncode == 2 and "$.parallelism.data: 2.0 is a float" in out.stderr and \
            "write 2, not 2.0" in out.stderr, out.stderr


def test_null_and_non_finite_numbers_are_reported(tmp_path):
    out = cli("validate", INVALID / "null_document.json")
    assert out.returncode == 2 and "$: the top level must be a JSON object (a recipe), not null" in out.stderr
    report = json.loads(cli("validate", INVALID / "null_document.json", "--json").stdout)
    assert report[0]["errors"] and report[0]["errors"][0]["path"] == "$"
    null = tmp_path / "null.json"
    null.write_text("null")
    out = cli("import", null)
    assert out.returncode == 2 and f"{null}: $: the top level must be a JSON object (a DeepSpeed config)" in out.stderr
    out = cli("validate", INVALID / "lr_infinity.json")
    assert out.returncode == 2 and "$.optimizer.lr: invalid JSON at line 20, column 11: Infinity" in out.stderr
    inf = tmp_path / "inf.json"
    inf.write_text('{"train_batch_size": 8,\n "optimizer": {"type": "Adam", "params": {"lr": NaN}}}')
    out = cli("import", inf)
    assert out.returncode == 2 and "$.optimizer.params.lr: invalid JSON at line 2, column 49: NaN" in out.stderr


def test_auto_recipe_rules_that_need_no_data_size_run_without_one():
    out = cli("validate", INVALID / "auto_too_few_micro_batches.json", INVALID / "auto_global_never_valid.json")
    assert out.returncode == 2 and "ok:" not in out.stdout
    assert "auto_too_few_micro_batches.json: $.batch: 2 micro-batches per step for 4 pipeline stages" in out.stderr
    assert "auto_global_never_valid.json: $.batch.global: global 10 is not a multiple of micro 4 x grad_accum 2" \
        in out.stderr


def test_import_plain_deepspeed_optimizers(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                              "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}))
    recipe_path = tmp_path / "mine.json"
    out = cli("import", ds, "--world-size", "8", "-o", recipe_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(recipe_path.read_text())["optimizer"] == {
        "name": "adamw", "lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    again = json.loads(cli("export", recipe_path, "--to", "deepspeed").stdout)
    assert again["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                              "weight_decay": 0.0}}


def test_import_reads_auto_precision_as_not_given_and_says_so(tmp_path):
    """Hugging Face's "enabled": "auto" is decided at run time: the recipe takes fp32 and warns, never bf16."""
    ds = tmp_path / "hf.json"
    ds.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                              "bf16": {"enabled": "auto"}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}))
    out = cli("import", ds, "--world-size", "8")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["precision"] == "fp32" and "bf16" not in data.get("deepspeed", {}), data
    assert f'{ds}: $.bf16.enabled: warning: "auto"' in out.stderr and "set $.precision" in out.stderr


def test_import_problems_name_the_file(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 16, "optimizer": {"type": "Lamb"}}))
    out = cli("import", ds, "--world-size", "8")
    assert out.returncode == 2
    assert f"{ds}: $.deepspeed.optimizer.type: \"Lamb\" contradicts" in out.stderr, out.stderr
    assert all(line.startswith(f"{ds}: $") for line in out.stderr.splitlines()), out.stderr


def test_summary_says_one_process():
    out = cli("validate", "cpu_single")
    assert out.returncode == 0 and "= 1 process;" in out.stdout, out.stdout


def test_an_expert_axis_exports_as_autoep_imports_back_and_accelerate_refuses_it(tmp_path):
    """DeepSpeed 0.19's config carries an expert axis as AutoEP's expert_parallel section (enabled, autoep_size), which
    imports back as "expert" (launcher auto: the plugin trains it natively), its other keys kept raw; Accelerate's
    config has no key for it: refused rather than lost."""
    recipe = tmp_path / "moe_ep2.json"
    recipe.write_text(json.dumps({"name": "moe_ep2", "batch": {"global": 8, "micro": 1},
                                  "parallelism": {"data": 4, "expert": 2},
                                  "model": {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 32,
                                            "moe": {"experts": 4}}}))
    out = cli("export", recipe, "--to", "accelerate")
    assert out.returncode == 2 and "$.parallelism.expert: expert 2" in out.stderr and not out.stdout
    out = cli("export", recipe, "--to", "deepspeed")
    assert out.returncode == 0 and "AutoEP" in out.stderr, out.stderr
    ds = json.loads(out.stdout)
    assert ds["expert_parallel"] == {"enabled": True, "autoep_size": 2, "expert_tensor_parallel_size": 1}, ds
    ds["expert_parallel"]["preset_model"] = "mixtral"
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    out = cli("import", tmp_path / "ds.json", "--world-size", "4")
    assert out.returncode == 0, out.stderr
    back = json.loads(out.stdout)
    assert back["parallelism"]["expert"] == 2 and back["launcher"] == "auto", back
    assert back["deepspeed"]["expert_parallel"] == {"preset_model": "mixtral"}, back
    shown = json.loads(cli("show", recipe, "--json").stdout)
    assert shown["resolved"]["expert"] == 2 and shown["ranks"][1]["expert_peers"] == [0, 1]
