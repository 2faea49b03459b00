"""Tensor-parallel plans without processes: every user error is caught before any swap, names the module,
the values and the fix; tp=1 (no group) swaps layers and computes the same function."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from plugin.models import GPT, GPTConfig, gpt_loss
from plugin.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelError,
    apply_tensor_parallel,
    padding_report,
    parse_style,
    resolve_plan,
)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 30), nn.GELU(), nn.Linear(30, 8), nn.LayerNorm(8))


def gpt(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**dict(vocab=37, hidden=32, layers=2, heads=8, kv_heads=4, seq_len=8), **kw}))


def problems_of(model, plan, tp, **kw) -> str:
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TensorParallelError) as info:
        resolve_plan(model, plan, tp, **kw)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), "a rejected plan must leave the model untouched"
    return str(info.value)


def test_styles_parse_and_unknown_styles_list_the_accepted_ones():
    assert parse_style("column:3").parts == 3
    assert parse_style("colwise").kind == "column" and parse_style("rowwise").kind == "row"
    assert parse_style("vocab_gather").gather_output
    with pytest.raises(ValueError, match="column_gather"):
        parse_style("diagonal")


def test_glob_matching_nothing_names_the_glob_and_suggests():
    text = problems_of(mlp(), {"0": "column", "3x": "row"}, 2)
    assert "'3x' matches no module of Sequential; its linear/embedding modules are named like '0', '2'" in text
    plan = dict(gpt().tensor_parallel_plan(), **{"blocks.*.atn.qkv": "column"})
    assert ("'blocks.*.atn.qkv' matches no module of GPT; did you mean 'blocks.*.attn.qkv'"
            in problems_of(gpt(), plan, 2))


def test_style_that_does_not_fit_names_the_module():
    text = problems_of(mlp(), {"3": "column"}, 2)
    assert "module '3' (LayerNorm)" in text and "'replicate'" in text
    text = problems_of(nn.Sequential(nn.Embedding(10, 4)), {"0": "row"}, 2)
    assert "module '0' (nn.Embedding 10x4)" in text and "'vocab'" in text
    text = problems_of(nn.Sequential(nn.Embedding(10, 4, max_norm=1.0)), {"0": "vocab"}, 2)
    assert "does not support its option(s) ['max_norm']" in text


def test_dimension_not_divisible_names_module_and_values():
    text = problems_of(mlp(), {"0": "column", "2": "row"}, 4)
    assert "module '0' (Linear 8->30): 30 output features are not divisible by tensor size 4" in text
    assert "module '2' (Linear 30->8): 30 input features are not divisible by tensor size 4" in text


def test_all_problems_are_reported_at_once():
    err = pytest.raises(TensorParallelError, resolve_plan, mlp(), {"0": "column", "2": "row", "zz": "row",
                                                                    "1": "sideways"}, 4).value
    assert len(err.problems) == 4, err.problems


def test_two_globs_giving_one_module_two_styles():
    assert "matched by '0' (column) and by '*0' (row)" in problems_of(mlp(), {"0": "column", "*0": "row"}, 2)


def test_tied_weights_must_be_split_alike():
    model = gpt(tie_embeddings=True)
    plan = dict(model.tensor_parallel_plan(), head="replicate")
    text = problems_of(model, plan, 2)
    assert "'embed', 'head' share one weight" in text


def test_gpt_checks_heads_pairs_head_and_sequence():
    assert "kv_heads 4 cannot be split whole over tensor size 8" in problems_of(gpt(), "auto", 8)
    plan = dict(gpt().tensor_parallel_plan(), **{"blocks.*.attn.proj": "replicate"})
    assert "blocks.0: attn.qkv is 'column' and attn.proj is 'whole'" in problems_of(gpt(), plan, 2)
    plan = dict(gpt().tensor_parallel_plan(), head="replicate")
    assert "head is 'whole'" in problems_of(gpt(), plan, 2)
    assert "seq_len 6 is not divisible by tensor size 4" in problems_of(gpt(seq_len=6), "auto", 4,
                                                                           sequence_parallel=True)


def test_sequence_parallel_needs_a_model_that_supports_it():
    assert "sequence parallelism needs a model" in problems_of(mlp(), {"0": "column", "2": "row"}, 2,
                                                              sequence_parallel=True)


def test_auto_on_an_unknown_model_says_what_to_pass():
    with pytest.raises(TensorParallelError, match="no automatic tensor-parallel plan for Sequential"):
        resolve_plan(mlp(), "auto", 2)


def test_gpt2_fused_qkv_must_be_split_in_three_parts():
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=4,
                                                                 n_positions=8, bos_token_id=0, eos_token_id=0))
    assert set(resolve_plan(model, "auto", 2)) == {"transformer.wte", "lm_head", "transformer.h.0.attn.c_attn",
                                                  "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
                                                  "transformer.h.0.mlp.c_proj"}
    text = problems_of(model, {"transformer.h.*.attn.c_attn": "column", "transformer.h.*.attn.c_proj": "row"}, 2)
    assert "style 'column:3'" in text
    assert "4 attention heads cannot be split whole over tensor size 8" in problems_of(
        model, {"transformer.h.*.attn.c_attn": "column:3"}, 8)


def test_without_a_group_the_swapped_sequential_computes_the_same():
    whole, split = mlp(), mlp()
    apply_tensor_parallel(split, {"0": "column", "2": "row"}, None)
    assert isinstance(split[0], ColumnParallelLinear) and isinstance(split[2], RowParallelLinear)
    assert split[0].weight.tensor_model_parallel and not hasattr(split[2].bias, "tensor_model_parallel")
    x = torch.randn(3, 8)
    torch.testing.assert_close(split(x), whole(x))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_without_a_group_the_gpt_computes_the_same(sequence_parallel):
    whole, split = gpt(tie_embeddings=True), gpt(tie_embeddings=True)
    layers = split.to_layers()  # taken before sharding, as a pipeline engine may
    apply_tensor_parallel(split, "auto", None, sequence_parallel=sequence_parallel)
    assert split.head.weight is split.embed.weight
    assert [id(m) for m in split.to_layers()] == [id(m) for m in layers], "the layer list is stable"
    assert layers[0].embed is split.embed and layers[-1].head is split.head, "and follows the swap"
    tokens = torch.randint(0, 37, (2, 8))
    torch.testing.assert_close(gpt_loss(split(tokens), tokens), gpt_loss(whole(tokens), tokens), rtol=1e-6, atol=0)
    assert set(dict(split.named_parameters())) == set(dict(whole.named_parameters())), "same names"
    assert padding_report(split) == {}


def test_transformers_styles_the_plugin_lacks_are_unsupported_not_unknown():
    with pytest.raises(ValueError) as info:
        parse_style("sequence_parallel")
    text = str(info.value)
    assert text.startswith("unsupported style 'sequence_parallel': the plugin's sequence parallelism is the recipe's "
                           "tensor_parallel.sequence_parallel") and "supported: column" in text
    assert "'replicate' to leave it whole" in text
    with pytest.raises(ValueError, match=r"unsupported style 'local_colwise': .*supported: column, column:K"):
        parse_style("local_colwise")
    with pytest.raises(ValueError, match=r"^unknown style 'diagonal' \(supported: "):
        parse_style("diagonal")
    text = problems_of(mlp(), {"0": "local_rowwise"}, 2)
    assert "plan entry '0': unsupported style 'local_rowwise'" in text


class _Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(30, 8)
        self.layers = nn.ModuleList(nn.ModuleDict({"up": nn.Linear(8, 16), "down": nn.Linear(16, 8)})
                                    for _ in range(2))


class _TransformersLike(nn.Module):
    """What auto reads from a transformers model without ``_tp_plan``: ``config.base_model_tp_plan``, whose
    names are relative to ``base_model`` (found under ``base_model_prefix``)."""

    base_model_prefix = "model"

    def __init__(self):
        super().__init__()
        from types import SimpleNamespace

        self.model = _Base()
        self.lm_head = nn.Linear(8, 30, bias=False)
        self.config = SimpleNamespace(model_type="tiny", vocab_size=30, base_model_tp_plan={
            "embed_tokens": "embedding_rowwise", "layers.*.up": "colwise", "layers.*.down": "rowwise"})

    @property
    def base_model(self):
        return self.model

    def get_input_embeddings(self):
        return self.model.embed_tokens


def test_auto_falls_back_to_the_configs_base_model_tp_plan_under_the_prefix():
    torch.manual_seed(0)
    model = _TransformersLike()
    assert getattr(model, "_tp_plan", None) is None
    styles = resolve_plan(model, "auto", 2)
    assert {n: s.kind for n, s in styles.items()} == {
        "model.embed_tokens": "vocab", "model.layers.0.up": "column", "model.layers.1.up": "column",
        "model.layers.0.down": "row", "model.layers.1.down": "row"}
    # the fallback has no head entry: an embedding tied to the (whole) head must stay whole too
    model.lm_head.weight = model.model.embed_tokens.weight
    styles = resolve_plan(model, "auto", 2)
    assert "model.embed_tokens" not in styles and "lm_head" not in styles
    assert set(styles) == {"model.layers.0.up", "model.layers.1.up", "model.layers.0.down", "model.layers.1.down"}


def test_recipe_schema_lists_the_style_table_and_transformers_names():
    from plugin.recipe.schema import load_schema
    from plugin.tensor_parallel.styles import HF_NAMES, TABLE, schema_names

    plan = load_schema()["properties"]["tensor_parallel"]["properties"]["plan"]
    enum = next(a["additionalProperties"]["enum"] for a in plan["anyOf"] if "additionalProperties" in a)
    assert enum == schema_names(), "schemas/recipe.schema.json's plan styles drifted from styles.TABLE"
    for name in list(HF_NAMES) + [e.name for e in TABLE if ":" not in e.name]:
        assert name in enum and parse_style(name)


def test_the_docs_style_table_is_the_code_table():
    """docs/tensor-parallel.md's style table is styles.TABLE, row by row (issue 20: generated from the code's table)."""
    from pathlib import Path

    from plugin.tensor_parallel.styles import TABLE

    rows = [f"| `{e.name}` | {', '.join(e.hf) or '-'} | {e.targets.replace(' | ', ', ')} |" for e in TABLE]
    doc = (Path(__file__).resolve().parents[3] / "docs" / "tensor-parallel.md").read_text()
    table = "| plugin style | transformers style | applies to |\n|---|---|---|\n" + "\n".join(rows) + "\n\n"
    assert table in doc, "docs/tensor-parallel.md's style table is not styles.TABLE:\n" + table


def test_a_recipe_states_fewer_kv_heads_than_tensor_only_with_a_per_head_plan():
    """validate cannot see what "auto" resolves to: kv_heads 1 at tensor 2 is refused (the fix names unit_colwise),
    unless the plan names the per-head style, whose names are the style table's (initialize then checks the model)."""
    from plugin.recipe.checks import PER_HEAD_STYLES, check_recipe
    from plugin.recipe.spec import Recipe
    from plugin.tensor_parallel.styles import BY_NAME

    assert set(PER_HEAD_STYLES) == {"column_heads", *BY_NAME["column_heads"].hf}
    base = {"name": "r", "parallelism": {"data": 1, "tensor": 2, "pipeline": 1}, "batch": {"global": 2, "micro": 1},
            "model": {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 1, "vocab": 128, "seq_len": 32}}

    def kv_errors(plan):
        recipe = Recipe.from_dict({**base, "tensor_parallel": {"plan": plan}})
        return [p.format() for p in check_recipe(recipe, 2) if p.is_error and p.path == "$.model.kv_heads"]

    assert [e for e in kv_errors("auto") if "kv_heads 1 is not divisible by tensor 2" in e and "'unit_colwise'" in e]
    for style in PER_HEAD_STYLES:
        assert kv_errors({"layers.*.k_proj": style, "layers.*.v_proj": style, "layers.*.o_proj": "row"}) == []
    assert kv_errors({"layers.*.k_proj": "colwise"})  # a plain column split of the heads: refused as ever
