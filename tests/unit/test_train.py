"""train.py refuses what it cannot train with a message and exit 2, before any process group (no traceback)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train

pytestmark = pytest.mark.nods  # also in the venv without deepspeed: train.py's start without deepspeed

ROOT = Path(__file__).resolve().parents[2]


def test_transformers_model_without_transformers_is_a_message(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # leave this process's thread count alone
    assert train.main(["--recipe", "cpu_single", "--model", "gpt2"]) == 2
    assert "--model gpt2 needs transformers -> pip install transformers" in capsys.readouterr().err
    assert not torch.distributed.is_initialized()


def test_recipe_without_a_model_block(capsys):
    assert train.main(["--recipe", str(ROOT / "examples" / "lenet_dp.json")]) == 2
    assert "lenet_dp.json: $.model: train.py builds its model from the recipe's model block -> add one" in \
        capsys.readouterr().err


def test_resume_auto_and_elastic_need_a_save_directory(capsys):
    assert train.main(["--recipe", "cpu_single", "--resume", "auto"]) == 2
    assert "--resume auto resumes from the --save directory's latest complete step: give --save DIR" in \
        capsys.readouterr().err
    assert train.main(["--recipe", "cpu_single", "--elastic"]) == 2
    assert "--elastic resumes every restart from --save's latest complete step: give --save DIR" in \
        capsys.readouterr().err
    assert train.main(["--recipe", "cpu_single", "--elastic", "--save", "ck", "--resume", "old"]) == 2
    assert "give --save DIR (and no --resume old)" in capsys.readouterr().err


def test_a_surplus_rank_of_an_elastic_start_exits_0_at_once_before_any_group(tmp_path, monkeypatch, capsys):
    data = json.loads((ROOT / "recipes" / "cpu_tp2_dp2.json").read_text())
    data["name"], data["parallelism"] = "el", {"data": "auto", "tensor": 2, "pipeline": 1}
    (tmp_path / "el.json").write_text(json.dumps(data))
    for key, value in {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(key, value)
    assert train.main(["--recipe", str(tmp_path / "el.json"), "--elastic", "--save", str(tmp_path / "ck")]) == 0
    assert capsys.readouterr().err.strip() == (
        "elastic: rank 2 sits out this start (exit 0 now, back at the next restart): el trains on 2 of the 3 "
        "processes, data 1 x tensor 2 x pipeline 1, the most it can use")
    assert not torch.distributed.is_initialized() and not (tmp_path / "ck").exists()


def test_a_second_job_and_an_unwritable_metrics_path_are_refused_before_torch_is_imported(tmp_path):
    """train.py imports torch only once its start is not refused: a --save directory another live job holds (the
    job's lock, rank 0's first act), a --metrics file whose directory cannot be made (before any process group)."""
    from plugin.job.lock import SaveLock

    (tmp_path / "file").write_text("")
    argvs = [["--recipe", "cpu_single", "--save", str(tmp_path / "ck")],
             ["--recipe", "cpu_single", "--metrics", str(tmp_path / "file" / "m.jsonl")]]
    script = ("import json, sys, train\n"
              "print([(train.main(argv), 'torch' in sys.modules) for argv in json.loads(sys.argv[1])])")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "TORCHELASTIC", "PLUGIN_"))}
    with SaveLock(tmp_path / "ck", "the-other-run"):
        out = subprocess.run([sys.executable, "-c", script, json.dumps(argvs)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[(2, False), (2, False)]", out.stdout + out.stderr
    assert "--save " + str(tmp_path / "ck") + ": another job is training into this directory: run the-other-run" \
        in out.stderr
    assert f"--metrics {tmp_path / 'file' / 'm.jsonl'}: cannot make its directory" in out.stderr
