"""The first mistakes a new user makes with the CLI (issue 21): each one line that says what to do, no traceback."""
import importlib.util
import json
import os
import shlex
import subprocess
import sys

import pytest

from .test_cli import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
HEADS_12_AT_TP16 = {"name": "h", "parallelism": {"data": 1, "tensor": 16, "pipeline": 1},
                    "batch": {"global": 16, "micro": 16},
                    "model": {"layers": 4, "hidden": 768, "heads": 12, "vocab": 50304, "seq_len": 1024}}


def _said(out) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    return out.stderr


def test_estimate_validates_like_show_and_names_only_written_fields(tmp_path):
    path = tmp_path / "h.json"
    path.write_text(json.dumps(HEADS_12_AT_TP16))
    for command in ("estimate", "show", "validate"):
        out = cli(command, path)
        assert out.returncode == 2, (command, out.stdout, out.stderr)
        said = _said(out)
        assert "$.model.heads: heads 12 is not divisible by tensor 16" in said and "kv_heads" not in said, said
        assert "FITS" not in out.stdout
    written = {**HEADS_12_AT_TP16, "model": {**HEADS_12_AT_TP16["model"], "kv_heads": 4}}
    path.write_text(json.dumps(written))
    assert "$.model.kv_heads: kv_heads 4 is not divisible by tensor 16" in _said(cli("validate", path))


def test_a_deepspeed_config_an_accelerate_yaml_and_an_empty_file_are_said_for_what_they_are(tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
                              "zero_optimization": {"stage": 2}}))
    acc = tmp_path / "acc.yaml"
    acc.write_text('compute_environment: "LOCAL_MACHINE"\ndistributed_type: "DEEPSPEED"\nnum_processes: 4\n')
    empty = tmp_path / "empty.json"
    empty.write_text("\n")
    for command in ("validate", "show", "estimate"):
        said = _said(cli(command, ds)).strip()
        assert said.count("\n") == 0 and "this is a DeepSpeed config" in said, said
        assert f"python -m plugin import {ds}" in said and "fp16" not in said, said
        said = _said(cli(command, acc)).strip()
        assert said.count("\n") == 0 and "this is an Accelerate config (YAML), not a recipe" in said, said
        out = cli(command, empty)
        assert out.returncode == 2 and _said(out).strip() == (
            f"{empty}: $: the file is empty -> write a recipe there: a recipe is JSON with parallelism, batch and "
            "model blocks (recipes/cpu_dp4.json is one)")
    out = cli("import", ds, "-o", tmp_path / "recipe.json")  # what the message says to run works
    assert out.returncode == 0 and cli("validate", tmp_path / "recipe.json").returncode == 0


# commands that print much on stdout, each as a newcomer types it ("ELASTIC": an elastic recipe written for the test)
PLAN = ("plan", "--model", "gpt3-125m", "--gpus", "8", "--gpu-memory", "80GB")
PRINTING = [("show", "cpu_tp2_pp2"), ("show", "cpu_tp2_pp2", "--json"), ("estimate", "cpu_tp2_pp2"),
            ("estimate", "cpu_tp2_pp2", "--json"), PLAN, (*PLAN, "--json"), ("validate", "cpu_dp4", "cpu_tp2_pp2"),
            ("export", "cpu_tp2_pp2", "--to", "deepspeed"), ("export", "cpu_tp2_pp2", "--to", "accelerate"),
            ("elastic", "ELASTIC", "--nodes", "1:8", "--gpus-per-node", "8")]


@pytest.mark.parametrize("args", PRINTING, ids=lambda a: " ".join(a[:1] + a[-1:]))
def test_a_closed_stdout_ends_quietly(args, tmp_path):
    elastic = tmp_path / "elastic.json"
    elastic.write_text(json.dumps({"name": "elastic", "parallelism": {"data": "auto", "tensor": 2, "pipeline": 1},
                                   "batch": {"global": 64, "micro": 1}}))
    read, write = os.pipe()
    os.close(read)  # the reader has gone before the first line (`| head -1` that already ended)
    out = subprocess.run([sys.executable, "-m", "plugin", *(str(elastic) if a == "ELASTIC" else a for a in args)],
                         stdout=write, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=60)
    os.close(write)
    assert out.returncode == 0 and out.stderr == "", out.stderr


@pytest.mark.parametrize("command", ["show cpu_tp2_pp2", "estimate cpu_tp2_pp2",
                                     "plan --model gpt3-125m --gpus 8 --gpu-memory 80GB"])
def test_head_1_prints_one_line_and_exits_0(command):
    """The README's way: a real shell pipe into head -1 (pipefail: the plugin's own exit status)."""
    line = f"set -o pipefail; {shlex.quote(sys.executable)} -m plugin {command} | head -1"
    out = subprocess.run(["bash", "-c", line], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and out.stderr == "" and out.stdout.count("\n") == 1, (out.returncode, out.stderr)


def test_a_reader_that_leaves_after_the_first_line_of_a_long_rank_map(tmp_path):
    """The reader goes mid-output, for certain: 512 ranks of the rank map (about 100 kB) do not fit the pipe, so rich
    writes into a pipe whose reader has gone (rich's own console would exit 1 there)."""
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"name": "big", "parallelism": {"data": 256, "tensor": 2, "pipeline": 1},
                                "batch": {"global": 256, "micro": 1}}))
    proc = subprocess.Popen([sys.executable, "-m", "plugin", "show", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0 and err == "" and first.startswith("recipe big"), (first, err)


def _one_line(out) -> str:
    said = _said(out).strip()
    assert said and "\n" not in said and " -> " in said, said
    return said


FIRST_ARGUMENT = {  # command -> the arguments after its first one (a file or a directory)
    "validate": [], "show": [], "estimate": [], "export": ["--to", "deepspeed"], "import": [],
    "elastic": ["--nodes", "1:2", "--gpus-per-node", "4"], "plot": ["-o", "x.png"],
    "checkpoint inspect": [], "checkpoint check": ["cpu_dp4"], "checkpoint verify": [],
    "checkpoint export": ["-o", "x.safetensors"], "plan --model": ["--gpus", "8", "--gpu-memory", "80GB"]}


@pytest.mark.parametrize("command", FIRST_ARGUMENT)
def test_every_command_says_what_a_wrong_first_argument_is(command, tmp_path):
    """A missing file, a directory, and (for the commands that take a directory) a file: one line, what and the fix,
    exit 1 or 2, no traceback."""
    takes_directory = command.startswith("checkpoint")
    wrong = [tmp_path / "missing.json", tmp_path / ("a_file.json" if takes_directory else "")]
    (tmp_path / "a_file.json").write_text("{}")
    if command == "plot" and importlib.util.find_spec("matplotlib") is None:
        pytest.skip("plot needs matplotlib (the monitor extra) before it reads its files")
    for arg in wrong:
        out = cli(*command.split(), arg, *FIRST_ARGUMENT[command])
        said = _one_line(out)
        assert out.returncode in (1, 2) and str(arg) in said, (command, arg, said)
        kind = "file" if takes_directory else "directory"
        assert (kind in said) if arg.name != "missing.json" else ("no such" in said or "does not exist" in said), said


def test_plan_validates_a_recipe_as_validate_does(tmp_path):
    """plan --model RECIPE.json: the same problems as validate, exit 2; a recipe with no model block is said as such."""
    path = tmp_path / "h.json"
    path.write_text(json.dumps(HEADS_12_AT_TP16))
    out = cli("plan", "--model", path, *PLAN[3:])
    assert out.returncode == 2 and _said(out) == _said(cli("validate", path)) and "Top" not in out.stdout, out.stderr
    path.write_text(json.dumps({k: v for k, v in HEADS_12_AT_TP16.items() if k != "model"}
                               | {"parallelism": {"data": 1, "tensor": 1, "pipeline": 1}}))
    out = cli("plan", "--model", path, *PLAN[3:])
    assert out.returncode == 2 and "$.model: the recipe has no model block" in _said(out), out.stderr
    path.write_text("")
    out = cli("plan", "--model", path, *PLAN[3:])
    assert out.returncode == 2 and "$: the file is empty" in _one_line(out)
    out = cli("plan", "--model", os.path.join(ROOT, "recipes", "cpu_tp2_pp2.json"), *PLAN[3:])
    assert out.returncode == 0 and out.stderr == "" and "Top" in out.stdout, out.stderr
    path.write_text(json.dumps(HEADS_12_AT_TP16["model"]))  # a model block alone: not a recipe, read as before
    out = cli("plan", "--model", path, *PLAN[3:])
    assert out.returncode == 0 and "Top" in out.stdout, out.stderr


def test_a_recipe_given_without_a_command_names_one_to_run():
    out = cli("recipes/cpu_dp4.json")
    assert out.returncode == 1 and _one_line(out) == ("python -m plugin: 'recipes/cpu_dp4.json' is not a command -> "
                                                      "name one first: python -m plugin validate recipes/cpu_dp4.json "
                                                      "(or show, estimate, export, import; --help lists them all)")
    out = cli("valdate", "cpu_dp4")  # a misspelt command: argparse's own "invalid choice", with the list
    assert out.returncode == 1 and "invalid choice: 'valdate'" in out.stderr and "Traceback" not in out.stderr
