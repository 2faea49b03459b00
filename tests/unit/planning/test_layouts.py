"""The search's validity rules are the recipe checks': what the planner tries is exactly what ``validate`` accepts."""
from __future__ import annotations

import itertools

from plugin.planning.dims import ModelSpec
from plugin.planning.layouts import (
    context_methods,
    context_sizes,
    divisors,
    expert_sizes,
    pipeline_sizes,
    sequence_parallel_choices,
    tensor_sizes,
    zero_stages,
)
from plugin.recipe.checks import check_recipe
from plugin.recipe.spec import Recipe


def _errors(par: dict, model: dict, **blocks) -> list[str]:
    recipe = Recipe.from_dict({"name": "r", "parallelism": par, "batch": {"global": 2, "micro": 1},
                               "model": model, **blocks})
    world = par["data"] * par["tensor"] * par["pipeline"] * par.get("context", 1)
    return [p.format() for p in check_recipe(recipe, world) if p.is_error]


def test_tensor_context_method_and_sequence_parallel_are_searched_exactly_where_the_recipe_checks_pass():
    """Both ways, over head counts, grouped kv heads and sequence lengths that 2 x C (x T) does and does not divide:
    a combination the search tries passes the recipe checks, and one it does not try is refused by them."""
    tried = refused = 0
    for heads, kv, seq in itertools.product((4, 6, 12), (None, 2), (24, 30, 36, 64)):
        model = {"layers": 2, "hidden": 96, "heads": heads, "vocab": 128, "seq_len": seq,
                 **({"kv_heads": kv} if kv else {})}
        spec = ModelSpec(layers=2, hidden=96, heads=heads, kv_heads=kv, vocab=128, seq_len=seq, tied_embeddings=False)
        for tp, cp, method, sp in itertools.product((1, 2, 4), (1, 2, 3, 4), ("ring", "all_to_all"), (False, True)):
            if cp == 1 and method != "ring":
                continue  # a method at context 1 is a warning, and the search writes none
            searched = (tp in tensor_sizes(spec, tp * cp) and cp in context_sizes(spec, tp * cp)
                        and method in context_methods(spec, tp, cp) and sp in sequence_parallel_choices(spec, tp, cp))
            blocks = {"tensor_parallel": {"sequence_parallel": sp}}
            if cp > 1:
                blocks["context_parallel"] = {"method": method}
            errors = _errors({"data": 1, "tensor": tp, "pipeline": 1, "context": cp}, model, **blocks)
            assert searched == (not errors), (heads, kv, seq, tp, cp, method, sp, errors)
            tried += searched
            refused += not searched
    assert tried > 100 and refused > 100  # both sides of every rule were met


def test_zero_stages_searched_pass_the_recipe_checks_and_shard_something():
    model = {"layers": 4, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 32}
    for pp, data, cp in itertools.product((1, 2), (1, 2), (1, 2)):
        stages = zero_stages(data * cp, pp)
        assert stages == ([0] if data * cp == 1 else [0, 1] if pp > 1 else [0, 1, 2, 3])
        for stage in range(4):
            errors = _errors({"data": data, "tensor": 1, "pipeline": pp, "context": cp}, model,
                             zero={"stage": stage}, batch={"global": 2 * data, "micro": 1})
            if stage in stages:
                assert not errors, (pp, data, cp, stage, errors)
            elif pp > 1 and stage >= 2:
                assert any("ZeRO stage" in e for e in errors), (pp, stage)


def test_context_sizes_cut_the_sequence_into_two_chunks_per_rank():
    spec = ModelSpec(layers=2, hidden=64, heads=4, vocab=128, seq_len=3000)  # 2C | 3000: C | 1500
    assert context_sizes(spec, 16) == [1, 2, 4]
    assert context_sizes(spec, 12) == [1, 2, 3, 4, 6, 12]
    assert divisors(12) == [1, 2, 3, 4, 6, 12]


def test_moe_layouts_are_searched_exactly_where_the_recipe_checks_and_the_expert_axis_reach_pass():
    """Both ways, for a mixture of experts: tensor (each expert's inner size over it), pipeline, data, expert degree
    and sequence parallelism the search tries pass the recipe checks and what the expert axis reaches on the
    native back end (:func:`plugin.expert_parallel.checks.check_expert_reach`); what it does not try is refused."""
    from plugin.expert_parallel.checks import check_expert_reach

    tried = refused = 0
    for experts, fe, router in itertools.product((4, 6), (48, 90), ("softmax", "sigmoid")):
        moe = {"experts": experts, "top_k": 2, "ffn_hidden": fe, "router": router}
        model = {"layers": 2, "hidden": 96, "heads": 12, "vocab": 128, "seq_len": 64, "moe": moe}
        spec = ModelSpec(layers=2, hidden=96, heads=12, vocab=128, seq_len=64, tied_embeddings=False,
                         moe_experts=experts, moe_ffn_hidden=fe,
                         moe_options=(("router", router),) if router == "sigmoid" else ())
        for tp, pp, dp, ep, sp in itertools.product((1, 2, 4), (1, 2), (1, 2, 4), (1, 2, 3, 4), (False, True)):
            searched = (tp in tensor_sizes(spec, tp) and pp in pipeline_sizes(spec, pp) and ep in expert_sizes(spec, dp)
                        and sp in sequence_parallel_choices(spec, tp))
            par = {"data": dp, "tensor": tp, "pipeline": pp, "expert": ep}
            blocks = {"tensor_parallel": {"sequence_parallel": sp}, "batch": {"global": 4 * dp, "micro": 1}}
            errors = _errors(par, model, **blocks)
            if not errors:
                recipe = Recipe.from_dict({"name": "r", "parallelism": par, "model": model, **blocks})
                errors = [p.format() for p in check_expert_reach(recipe, recipe.layout(), "native", 1)]
            assert searched == (not errors), (experts, fe, router, tp, pp, dp, ep, sp, errors)
            tried += searched
            refused += not searched
    assert tried > 20 and refused > 100
