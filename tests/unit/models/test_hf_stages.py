"""A transformers causal LM as pipeline layers (plugin.models.hf_stages): for every family of the installed
transformers that declares a ``base_model_pp_plan`` (and GPT-2, by the plugin's own plan), composed on one process the
stage list is bitwise the model's own forward (``use_cache=False``) and gradients, with no mask, right/left padding and
packed positions, and its parameters are exactly the model's; or the family is refused, naming it and the reason
(tests/hf_families.py's ``PP_REFUSED``, pinned both ways). The wrappers follow modules swapped after they were made
(the tensor-parallel plan)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

tf = pytest.importorskip("transformers")

from plugin.errors import PluginError  # noqa: E402
from plugin.models.hf_stages import first_stage_inputs, is_hf_model, stage_layers, stage_problem  # noqa: E402
from tests.hf_families import PP_REFUSED, TINY, families_with_pp_plan, pp_model  # noqa: E402

SEQ = 16  # two windows of the tiny configs' 8 tokens
DIMS = dict(vocab_size=61, hidden_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=32, max_position_embeddings=32)


def build(kind):
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**DIMS))
    if kind == "qwen2_sliding":  # sliding layers from max_window_layers on
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**DIMS, use_sliding_window=True, sliding_window=3,
                                                  max_window_layers=1))
    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=61, n_embd=16, n_layer=3, n_head=4, n_positions=32,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def batches(vocab):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (3, SEQ), generator=gen)
    mask = torch.ones(3, SEQ, dtype=torch.long)
    mask[0, 11:] = 0  # right padding
    mask[1, :5] = 0  # left padding
    packed = torch.tensor([list(range(6)) + list(range(SEQ - 6))] * 3)  # two documents per row
    return {"none": {"input_ids": ids}, "padded": {"input_ids": ids, "attention_mask": mask},
            "packed": {"input_ids": ids, "position_ids": packed}}


def check_composes_exactly(model, name, cases=("none", "padded", "packed")):
    layers = stage_layers(model)
    assert {id(p) for layer in layers for p in layer.parameters()} == {id(p) for p in model.parameters()}
    assert [type(x).__name__ for x in (layers[0], layers[1], layers[-1])] == ["Embed", "DecoderLayer", "Head"]
    params = list(model.parameters())
    for case in cases:
        batch = batches(model.config.vocab_size)[case]
        ref = model(**batch, use_cache=False).logits
        ref.square().mean().backward()
        ref_grads = [p.grad for p in params]
        model.zero_grad(set_to_none=True)
        x = first_stage_inputs(batch)
        for layer in layers:
            x = layer(x)
        assert torch.equal(x, ref), f"{name} {case}: logits {(x - ref).abs().max()} off"
        x.square().mean().backward()
        for (pname, p), g in zip(model.named_parameters(), ref_grads, strict=True):
            assert (p.grad is None) == (g is None) and (g is None or torch.equal(p.grad, g)), f"{name} {case}: {pname}"
        model.zero_grad(set_to_none=True)


def _family_model(family, device="cpu"):
    tf.logging.set_verbosity_error()
    try:
        with torch.device(device):
            return pp_model(family, TINY)
    except Exception as e:  # the tiny sizing (tests/hf_families.py) cannot size it: nothing to cut
        pytest.skip(f"{family}: no tiny model ({type(e).__name__}: {str(e).strip().splitlines()[-1][:120]})")


@pytest.mark.parametrize("family", [*families_with_pp_plan(), "gpt2"] if tf else [])
def test_every_family_with_a_plan_composes_the_models_own_logits_or_is_refused_by_name(family):
    if family in PP_REFUSED:  # refused from its structure alone, before any weight exists: built on meta
        problem = stage_problem(_family_model(family, "meta"))  # (phi4_multimodal's towers are 870M parameters)
        assert problem is not None and PP_REFUSED[family] in problem and repr(family) in problem, problem
        with pytest.raises(PluginError, match="cannot be cut into pipeline stages"):
            stage_layers(_family_model(family, "meta"))
        return
    model = _family_model(family).eval()  # eval: dropouts a family hard-codes draw nothing
    assert stage_problem(model) is None, stage_problem(model)
    check_composes_exactly(model, family, cases=("padded",))  # the other cases: the test below


@pytest.mark.parametrize("kind", ["llama", "qwen2_sliding", "gpt2"])
def test_stage_list_is_the_models_own_forward_and_gradients_in_training_mode(kind):
    check_composes_exactly(build(kind), kind)


@pytest.mark.parametrize("family", ["olmoe", "nemotron"])  # a tensor-parallel plan, no pipeline plan
def test_a_family_without_a_plan_is_refused_with_that_reason(family):
    model = pp_model(family, TINY)
    assert not getattr(model.config, "base_model_pp_plan", None)
    problem = stage_problem(model)
    assert problem is not None and "declares no base_model_pp_plan" in problem and repr(family) in problem, problem
    with pytest.raises(PluginError, match="declares no base_model_pp_plan"):
        stage_layers(model)


def test_wrappers_follow_swapped_modules_and_the_cache_is_reused():
    model = build("llama")
    first = stage_layers(model)
    model.lm_head = torch.nn.Linear(16, 61, bias=False)  # what a tensor-parallel plan does to the head
    again = stage_layers(model)
    assert again[-1] is first[-1] and again[-1].lm_head is model.lm_head


def test_refusals_name_the_fix():
    assert is_hf_model(build("gpt2")) and not is_hf_model(torch.nn.Linear(2, 2))
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(PluginError, match="token_type_ids"):
        first_stage_inputs({"input_ids": ids, "token_type_ids": ids})
    with pytest.raises(PluginError, match="length 1"):
        first_stage_inputs({"input_ids": ids[:, :1]})
    with pytest.raises(PluginError, match="2-D attention_mask"):
        first_stage_inputs({"input_ids": ids, "attention_mask": torch.ones(2, 1, 5, 5)})
    mask = first_stage_inputs({"input_ids": ids})[1]
    assert mask.shape == (2, 1) and mask.dtype == torch.int64


def test_transformers_gradient_checkpointing_is_refused_for_the_recipes_field():
    from plugin.engines.model_checks import check_model
    from plugin.recipe.checks import load_recipe

    model = build("llama")
    recipe = load_recipe("cpu_single")
    assert not [p for p in check_model(model, recipe) if p.is_error]
    model.gradient_checkpointing_enable()
    errors = [p.format() for p in check_model(model, recipe) if p.is_error]
    assert len(errors) == 1 and "$.activation_checkpointing" in errors[0]
    assert "gradient_checkpointing_enable" in errors[0] and '"mode": "full"' in errors[0]


def test_recompute_a_transformers_model_cannot_take_is_refused_by_name():
    """Outside pipelines a transformers model checkpoints each decoder layer (spans need keyword arguments carried
    from layer to layer), and it has no attention-core hook for selective recompute."""

    from plugin.engines.model_checks import check_model
    from plugin.recipe.checks import load_recipe
    from plugin.recipe.spec import ActivationCheckpointing

    model, recipe = build("llama"), load_recipe("cpu_single")

    def errors(mode, every=1, pipeline=1):
        r = dataclasses.replace(recipe, activation_checkpointing=ActivationCheckpointing(mode, every),
                                parallelism=dataclasses.replace(recipe.parallelism, pipeline=pipeline))
        return [p.format() for p in check_model(model, r) if p.is_error]

    assert errors("full") == [] and errors("full", 2, pipeline=2) == []
    spans = errors("full", 2)
    assert len(spans) == 1 and "$.activation_checkpointing.every" in spans[0] and '"every": 1' in spans[0]
    selective = errors("selective")
    assert len(selective) == 1 and "$.activation_checkpointing.mode" in selective[0]
    assert 'use "mode": "full"' in selective[0]
