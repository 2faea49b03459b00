"""Per-block sharding units (issue 12, deliverable 2), without processes: the native back end's ZeRO-2/3 and
Accelerate's FSDP2 plugin wrap one unit per transformer block (the reference GPT's ``Block``s; a transformers
model's ``_no_split_modules`` classes, its decoder layers), the root holding the rest. The FSDP2 wrap itself is
checked in tests/dist/test_meta_init.py (native ZeRO-3 dp4: blocks + root)."""
import pytest
import torch

from plugin.engines.initialize import layers_of
from plugin.engines.native.fsdp import fsdp_units, no_split_classes
from plugin.models.gpt import GPT, GPTConfig


def test_the_reference_gpt_gets_one_unit_per_block():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=32, hidden=16, layers=3, heads=2, seq_len=8))
    assert fsdp_units(model, layers_of) == list(model.blocks)
    with torch.device("meta"):  # a tied head: the embedding and head stay with the root, the blocks are units
        tied = GPT(GPTConfig(vocab=32, hidden=16, layers=3, heads=2, seq_len=8, tie_embeddings=True))
    assert fsdp_units(tied, layers_of) == list(tied.blocks)


def test_a_transformers_llama_gets_one_unit_per_decoder_layer_named_by_no_split_modules():
    transformers = pytest.importorskip("transformers")
    from plugin.engines.accelerate import fsdp_layer_classes

    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    assert fsdp_units(model, layers_of) == list(model.model.layers)  # not the stage wrappers layers_of makes
    assert no_split_classes(model) == ["LlamaDecoderLayer"]
    assert fsdp_layer_classes(model, layers_of) == sorted(model._no_split_modules)  # what Accelerate's FSDP2 wraps


def test_accelerates_fsdp2_plugin_reduces_bf16_gradients_in_fp32():
    """Accelerate's own default would reduce them in bf16 (``reduce_dtype`` = the compute dtype); CUDA-only mode,
    so only the plugin it is handed is checked here."""
    pytest.importorskip("accelerate")
    from plugin.engines.accelerate import _plugins
    from plugin.recipe.checks import load_recipe
    from plugin.recipe.spec import Recipe

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=32, hidden=16, layers=2, heads=2, seq_len=8))
    def policy(precision):
        recipe = Recipe.from_dict({**load_recipe("cpu_zero3_dp4").to_dict(), "precision": precision})
        return _plugins("fsdp", recipe, 4, True, model, layers_of, None)["fsdp_plugin"].mixed_precision_policy

    bf16 = policy("bf16")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32), bf16
    assert policy("fp32") is None, "fp32: FSDP2's default policy, nothing cast"
