"""The recipe's model block <-> transformers configs (plugin.models.hf_config), and train.py --model with them."""
from __future__ import annotations

import json

import pytest

from plugin.errors import PluginError
from plugin.models.hf_config import config_problems, family_config, read_config
from plugin.recipe.checks import load_recipe

DIMS = load_recipe("cpu_tp2_pp2").model  # layers 4, hidden 64, heads 4, ffn 256, vocab 128, seq 64


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt2"])
def test_a_family_sized_by_the_recipe_agrees_with_the_recipe(family):
    model_type, kwargs = family_config(family, DIMS)
    assert config_problems({"model_type": model_type, **kwargs}, DIMS, "x") == []


def test_each_disagreement_names_both_values(tmp_path):
    _, kwargs = family_config("llama", DIMS)
    config = {"model_type": "llama", **kwargs, "hidden_size": 96, "num_key_value_heads": 2, "intermediate_size": 100,
              "max_position_embeddings": 32}
    text = [p.format() for p in config_problems(config, DIMS, "my/config.json")]
    assert "$.model.hidden: the recipe says hidden 64, but my/config.json says hidden_size 96 -> set model.hidden " \
           "to 96 in the recipe, or use a config with hidden_size 64" in text
    assert any("kv_heads 4 (heads, since kv_heads is not set), but my/config.json says num_key_value_heads 2" in t
               for t in text)
    assert any("seq_len 64, but my/config.json says max_position_embeddings 32" in t for t in text)
    assert len(text) == 4
    gpt2 = {"model_type": "gpt2", **family_config("gpt2", DIMS)[1], "n_inner": None}
    assert config_problems(gpt2, DIMS, "c") == []  # n_inner None means 4 x n_embd = 256, the recipe's ffn_hidden
    assert [p.path for p in config_problems({**gpt2, "n_embd": 32}, DIMS, "c")] == ["$.model.hidden",
                                                                                    "$.model.ffn_hidden"]


def test_config_paths_are_read_and_checked(tmp_path, capsys):
    with pytest.raises(PluginError, match="no such config file"):
        read_config(tmp_path / "nope.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(PluginError, match="'bert' is not one of"):
        read_config(tmp_path)
    pytest.importorskip("transformers")
    import train

    _, kwargs = family_config("qwen2", DIMS)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", **kwargs, "num_hidden_layers": 2}))
    assert train.main(["--recipe", "cpu_tp2_pp2", "--model", str(tmp_path), "--steps", "1"]) == 2
    assert "cpu_tp2_pp2.json: $.model.layers: the recipe says layers 4, but " in capsys.readouterr().err
