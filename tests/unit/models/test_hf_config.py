"""The recipe's model block <-> transformers configs (plugin.models.hf_config, pure; plugin.models.hf), and train.py
--model NAME / DIR with them."""
from __future__ import annotations

import dataclasses
import json

import pytest

from plugin.errors import PluginError, RecipeError
from plugin.models.hf_config import config_problems, read_config, size_config
from plugin.recipe.checks import load_recipe

DIMS = load_recipe("cpu_tp2_pp2").model  # layers 4, hidden 64, heads 4, ffn 256, vocab 128, seq 64
GPT2_MAP = {"hidden_size": "n_embd", "max_position_embeddings": "n_positions", "num_attention_heads": "n_head",
            "num_hidden_layers": "n_layer"}
LLAMA = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 8, "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096,
         "head_dim": 128, "attention_dropout": 0.0, "pad_token_id": 31999}


def test_sizing_writes_the_recipe_under_the_family_names_and_fixes_derived_keys_by_rule():
    kwargs = size_config(LLAMA, DIMS)
    assert kwargs["hidden_size"] == 64 and kwargs["num_hidden_layers"] == 4 and kwargs["intermediate_size"] == 256
    assert kwargs["head_dim"] == 16 and kwargs["pad_token_id"] is None  # 31999 is outside a vocabulary of 128
    assert config_problems({**LLAMA, **kwargs}, DIMS, "x") == []
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None, "vocab_size": 50257,
            "n_positions": 1024, "resid_pdrop": 0.1, "embd_pdrop": 0.1}
    kwargs = size_config(gpt2, DIMS, GPT2_MAP)
    assert (kwargs["n_embd"], kwargs["n_layer"], kwargs["n_head"], kwargs["n_inner"]) == (64, 4, 4, 256)
    assert kwargs["resid_pdrop"] == kwargs["embd_pdrop"] == 0.0
    assert config_problems({**gpt2, **kwargs}, DIMS, "x", GPT2_MAP) == []


def test_sizing_rules_for_latent_attention_layer_lists_and_experts():
    mla = {**LLAMA, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
           "v_head_dim": 128, "qk_head_dim": 192, "head_dim": 64, "n_routed_experts": 256, "num_experts_per_tok": 8,
           "n_group": 8, "topk_group": 4, "n_shared_experts": 2, "moe_intermediate_size": 2752,
           "first_k_dense_replace": 3, "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 29}
    dims = dataclasses.replace(DIMS, layers=2, kv_heads=None)
    kwargs = size_config(mla, dims, experts=(4, 2))
    assert {k: kwargs[k] for k in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "qk_head_dim",
                                   "kv_lora_rank", "q_lora_rank")} == {
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "qk_head_dim": 16, "kv_lora_rank": 16,
        "q_lora_rank": 32}
    assert kwargs["head_dim"] == 8  # DeepSeek's head_dim is its rope dim: it stays that
    assert (kwargs["n_routed_experts"], kwargs["num_experts_per_tok"], kwargs["n_group"], kwargs["topk_group"],
            kwargs["n_shared_experts"]) == (4, 2, 1, 1, 1)
    assert kwargs["moe_intermediate_size"] == 64  # 2752 / 11008 of ffn 256
    assert kwargs["first_k_dense_replace"] == 1 and kwargs["mlp_layer_types"] == ["dense", "sparse"]
    assert "n_routed_experts" not in size_config(mla, dims)  # without experts=, the family's own count
    problems = config_problems({**mla, **size_config(mla, DIMS)}, dataclasses.replace(DIMS, kv_heads=2), "c")
    assert [p.format() for p in problems] == [
        "$.model.kv_heads: the recipe says kv_heads 2, but c (llama) has latent attention (kv_lora_rank): one "
        "key/value head per attention head -> set model.kv_heads to model.heads (4)"]
    kolibri = {**LLAMA, "index_num_heads": 12}  # an indexer scores keys with query heads of key/value head 0
    assert size_config(kolibri, dataclasses.replace(DIMS, kv_heads=2))["index_num_heads"] == 2
    assert size_config(kolibri, dataclasses.replace(DIMS, kv_heads=None))["index_num_heads"] == 1
    sliding = {**LLAMA, "num_hidden_layers": 6, "layer_types": ["sliding"] * 5 + ["full"], "num_kv_shared_layers": 3}
    kwargs = size_config(sliding, dataclasses.replace(DIMS, layers=2))
    assert kwargs["layer_types"] == ["sliding", "full"] and kwargs["num_kv_shared_layers"] == 0


def test_each_disagreement_names_both_values():
    config = {**LLAMA, **size_config(LLAMA, DIMS), "hidden_size": 96, "num_key_value_heads": 2,
              "intermediate_size": 100, "max_position_embeddings": 32}
    text = [p.format() for p in config_problems(config, DIMS, "my/config.json")]
    assert "$.model.hidden: the recipe says hidden 64, but my/config.json says hidden_size 96 -> set model.hidden " \
           "to 96 in the recipe, or use a config with hidden_size 64" in text
    assert any("kv_heads 4 (heads, since kv_heads is not set), but my/config.json says num_key_value_heads 2" in t
               for t in text)
    assert any("seq_len 64, but my/config.json says max_position_embeddings 32" in t for t in text)
    assert len(text) == 4
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 4, "n_head": 4, "n_inner": None, "vocab_size": 128,
            "n_positions": 64}
    assert config_problems(gpt2, DIMS, "c", GPT2_MAP) == []  # n_inner None means 4 x n_embd = 256
    assert [p.path for p in config_problems({**gpt2, "n_embd": 32}, DIMS, "c", GPT2_MAP)] == ["$.model.hidden",
                                                                                              "$.model.ffn_hidden"]
    gqa = config_problems(gpt2, dataclasses.replace(DIMS, kv_heads=2), "c", GPT2_MAP)
    assert [p.format() for p in gqa] == ["$.model.kv_heads: the recipe says kv_heads 2, but c (gpt2) has no "
                                         "grouped-query attention -> drop model.kv_heads or set it to model.heads"]


def test_every_causal_lm_family_is_sized_by_the_recipe_or_refused_by_name():
    """Every model_type AutoModelForCausalLM maps: its config sized by the recipe agrees with the recipe, or the
    refusal names the family (configs only: the tiny models are built by the tensor-parallel plan test)."""
    pytest.importorskip("transformers")
    from plugin.models.hf import causal_lm_types, family_config

    sized, refused = [], {}
    for model_type in causal_lm_types():
        try:
            config = family_config(model_type, DIMS)
        except PluginError as e:
            assert model_type in str(e), (model_type, str(e))
            refused[model_type] = str(e)
            continue
        problems = config_problems(config.to_dict(), DIMS, model_type, type(config).attribute_map)
        assert not [p for p in problems if p.is_error], (model_type, problems)
        sized.append(model_type)
    for family in ("llama", "qwen2", "mistral", "gpt2", "gemma2", "qwen3", "phi3", "gpt_neox", "cohere", "mixtral",
                   "deepseek_v3", "qwen3_moe", "gemma3"):
        assert family in sized, (family, refused.get(family))
    assert len(sized) >= 150, (len(sized), refused)


def test_config_paths_are_read_and_checked(tmp_path, capsys):
    with pytest.raises(PluginError, match="no such config file"):
        read_config(tmp_path / "nope.json")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 3}))
    with pytest.raises(PluginError, match="no model_type"):
        read_config(tmp_path)
    pytest.importorskip("transformers")
    import train
    from plugin.models.hf import build_hf_model, family_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(PluginError, match="'t5' is not a causal LM that AutoModelForCausalLM builds"):
        build_hf_model(str(tmp_path), DIMS)
    with pytest.raises(PluginError, match="did you mean qwen3"):
        build_hf_model("qwen33", DIMS)
    kwargs = family_config("qwen3", DIMS).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**kwargs, "num_hidden_layers": 2}))
    assert train.main(["--recipe", "cpu_tp2_pp2", "--model", str(tmp_path), "--steps", "1"]) == 2
    assert "cpu_tp2_pp2.json: $.model.layers: the recipe says layers 4, but " in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps(kwargs))
    model = build_hf_model(str(tmp_path), DIMS)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.num_hidden_layers == 4
    with pytest.raises(RecipeError, match="the gpt2 family .gpt2. has no grouped-query attention"):
        build_hf_model("gpt2", dataclasses.replace(DIMS, kv_heads=2))
    gemma2 = build_hf_model("gemma2", DIMS)
    assert (gemma2.config.hidden_size, gemma2.config.head_dim, gemma2.config.num_hidden_layers) == (64, 16, 4)
    assert type(build_hf_model("gemma3", DIMS)).__name__ == "Gemma3ForCausalLM"  # multimodal: its text model
