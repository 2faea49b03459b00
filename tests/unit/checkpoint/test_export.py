"""Exports a user loads (issue 13): a transformers model's export carries its config.json and generation_config.json
and loads with ``AutoModelForCausalLM.from_pretrained`` (tied GPT-2 included) with the trained model's logits; a
split export (``--max-shard-size``) writes files within the limit plus ``model.safetensors.index.json`` and loads
back, through ``from_pretrained`` and through the reference GPT's ``load_state_dict``. One process, native back end,
one training step each (so the weights are not the initial ones)."""
from __future__ import annotations

import json

import pytest
import torch

import plugin
from plugin.checkpoint.export import export, parse_size
from plugin.data.text import TextBatches
from plugin.errors import PluginError
from plugin.recipe.checks import load_recipe


def _trained(model, recipe):
    engine = plugin.initialize(model, recipe, backend="native")
    data = TextBatches(recipe.model.vocab, recipe.model.seq_len, seed=0)
    engine.train_step(data.global_batch(0, engine.layout.global_batch))
    return engine, data


def _files(out):
    """{file name: its tensors' data bytes} of an export, from the safetensors headers."""
    sizes = {}
    for f in sorted(out.glob("*.safetensors")):
        raw = f.read_bytes()
        header = json.loads(raw[8: 8 + int.from_bytes(raw[:8], "little")])
        sizes[f.name] = sum(t["data_offsets"][1] - t["data_offsets"][0] for k, t in header.items()
                            if k != "__metadata__")
    return sizes


def _check_split(out, limit, largest):
    index = json.loads((out / "model.safetensors.index.json").read_text())
    sizes = _files(out)
    assert len(sizes) > 2 and set(index["weight_map"].values()) == set(sizes)
    assert all(n <= max(limit, largest) for n in sizes.values()), sizes
    assert index["metadata"]["total_size"] == sum(sizes.values())
    return index


def test_gpt2_export_loads_with_from_pretrained_tied_and_split(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from plugin.models.hf import build_hf_model

    recipe = load_recipe("cpu_single")
    torch.manual_seed(0)
    model = build_hf_model("gpt2", recipe.model)
    assert model.config.tie_word_embeddings
    engine, data = _trained(model, recipe)
    try:
        engine.save(str(tmp_path / "ck"))
        x, _ = data.global_batch(1, 4)
        model.eval()
        with torch.no_grad():
            want = model(input_ids=x, use_cache=False).logits
        trained = {n: t.detach().clone() for n, t in model.state_dict().items()}
    finally:
        engine.close()
    largest = max(t.numel() * 4 for t in trained.values())
    for out, limit in ((tmp_path / "whole", None), (tmp_path / "split", 40_000)):
        export(str(tmp_path / "ck"), str(out), **({"max_shard_size": limit} if limit else {}))
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == "gpt2" and config["architectures"] == ["GPT2LMHeadModel"]
        assert (out / "generation_config.json").exists()
        if limit:
            _check_split(out, limit, largest)
        else:
            assert sorted(_files(out)) == ["model.safetensors"]
        loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # still tied
        got_sd = loaded.state_dict()
        assert all(torch.equal(got_sd[n], t) for n, t in trained.items()), out.name
        with torch.no_grad():
            got = loaded(input_ids=x, use_cache=False).logits
        assert torch.equal(got, want), f"{out.name}: max diff {(got - want).abs().max():.3e}"


def test_reference_gpt_split_export_through_the_cli_loads_with_load_state_dict(tmp_path):
    from safetensors.torch import load_file

    from plugin.cli.main import main
    from plugin.models.gpt import GPT, GPTConfig

    recipe = load_recipe("cpu_single")
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_recipe_model(recipe.model))
    engine, _ = _trained(model, recipe)
    try:
        engine.save(str(tmp_path / "ck"))
        trained = {n: t.detach().clone() for n, t in model.state_dict().items()}
    finally:
        engine.close()
    out = tmp_path / "split"
    assert main(["checkpoint", "export", str(tmp_path / "ck"), "-o", str(out), "--max-shard-size", "50kB"]) == 0
    index = _check_split(out, 50_000, max(t.numel() * 4 for t in trained.values()))
    tensors = {}
    for f in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(out / f)))
    assert sorted(tensors) == sorted(index["weight_map"]) == sorted(trained)
    fresh = GPT(GPTConfig.from_recipe_model(recipe.model))
    fresh.load_state_dict(tensors, strict=True)
    assert all(torch.equal(fresh.state_dict()[n], t) for n, t in trained.items())
    assert not (out / "config.json").exists() and (out / "recipe_model.json").exists()


@pytest.mark.parametrize("text,n", [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 * 2**30), ("1000", 1000),
                                    ("50kB", 50_000)])
def test_max_shard_size_parses_like_hugging_face(text, n):
    assert parse_size(text) == n
    with pytest.raises(PluginError, match="not a size"):
        parse_size("five")
