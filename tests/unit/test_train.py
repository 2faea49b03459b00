"""train.py refuses what it cannot train with a message and exit 2, before any process group (no traceback)."""
import sys
from pathlib import Path

import torch

import train

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
