"""initialize() refuses, before any process group exists, what would fail minutes later."""
import pytest
import torch

import plugin
from plugin.checks import load_recipe
from plugin.engine import choose_backend, layers_of
from plugin.errors import PluginError, RecipeError
from plugin.models.gpt import GPT, GPTConfig


@pytest.fixture
def launched_as(monkeypatch):
    def launched(world):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("LOCAL_RANK", "0")
    return launched


def test_world_size_mismatch(launched_as, capsys):
    launched_as(2)
    with pytest.raises(RecipeError) as e:
        plugin.initialize(torch.nn.Linear(2, 2), "cpu_dp4")
    assert "but the launcher runs 2" in str(e.value)
    assert "launch 4 processes" in capsys.readouterr().err, "rank 0 prints the problem"
    assert not torch.distributed.is_initialized()


def test_model_dims_against_the_recipe(launched_as):
    launched_as(4)
    model = GPT(GPTConfig(vocab=128, hidden=66, layers=4, heads=3, seq_len=64))
    with pytest.raises(RecipeError) as e:
        plugin.initialize(model, "cpu_tp2_dp2")
    text = str(e.value)
    assert "model GPT has heads 3, not divisible by tensor 2" in text
    assert not torch.distributed.is_initialized()


def test_explicit_world_size_must_match(launched_as):
    launched_as(4)
    with pytest.raises(RecipeError, match="initialize\\(world_size=8\\)"):
        plugin.initialize(torch.nn.Linear(2, 2), "cpu_dp4", world_size=8)


def test_backend_choice():
    import importlib.util

    has_ds = importlib.util.find_spec("deepspeed") is not None
    assert choose_backend(load_recipe("cpu_dp4")) == ("deepspeed" if has_ds else "native")
    data = load_recipe("cpu_tp2_pp2").to_dict()
    data["pipeline_parallel"]["schedule"] = "gpipe"
    assert choose_backend(plugin.Recipe.from_dict(data)) == "native"
    data["launcher"] = "torchrun"
    assert choose_backend(plugin.Recipe.from_dict(data)) == "native"


def test_layers_of():
    model = GPT(GPTConfig(vocab=16, hidden=8, layers=2, heads=2, seq_len=4))
    assert len(layers_of(model)) == 4
    assert len(layers_of(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))) == 2
    with pytest.raises(PluginError, match="ordered list of layers"):
        layers_of(torch.nn.Linear(2, 2))
