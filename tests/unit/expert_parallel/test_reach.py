"""What the expert axis does not reach yet is refused before any group (plugin/expert_parallel/checks.py), each at
its JSON path with a fix; what it reaches passes."""
from __future__ import annotations

from plugin.expert_parallel.checks import check_expert_reach
from plugin.recipe.spec import Recipe

MODEL = {"layers": 2, "hidden": 32, "heads": 4, "vocab": 128, "seq_len": 32, "moe": {"experts": 4}}


def _paths(parallelism, backend="native", layers=1, **blocks):
    blocks.setdefault("model", MODEL)
    recipe = Recipe.from_dict({"name": "t", "batch": {"global": 16, "micro": 1}, "parallelism": parallelism,
                               **blocks})
    problems = check_expert_reach(recipe, recipe.layout(), backend, layers)
    assert all(p.hint for p in problems)
    return [p.path for p in problems]


def test_a_transformers_moe_family_is_placed_where_its_experts_take_the_interface_and_refused_by_name_elsewhere():
    recipe = Recipe.from_dict({"name": "t", "batch": {"global": 16, "micro": 1}, "parallelism": {"data": 4,
                                                                                                "expert": 2}})
    (problem,) = check_expert_reach(recipe, recipe.layout(), "native", 0, "dbrx", True)
    assert "'dbrx' declares a base_model_ep_plan, but has no experts module that takes (hidden_states" in \
        problem.message
    assert check_expert_reach(recipe, recipe.layout(), "native", 0, "mixtral", True, hf_layers=2) == []

    def paths(parallelism, backend="native", router_logits=False):
        r = Recipe.from_dict({"name": "t", "batch": {"global": 16, "micro": 1}, "parallelism": parallelism})
        problems = check_expert_reach(r, r.layout(), backend, 0, "mixtral", True, 2, router_logits)
        assert all(p.hint and "mixtral" in p.message for p in problems)
        return [p.path for p in problems]

    assert paths({"data": 4, "expert": 2}, backend="deepspeed") == ["$.parallelism.expert"]
    assert paths({"data": 2, "tensor": 2, "expert": 2}) == ["$.parallelism.tensor"]
    assert paths({"data": 2, "pipeline": 2, "expert": 2}) == ["$.parallelism.pipeline"]
    assert paths({"data": 4, "expert": 2}, router_logits=True) == ["$.parallelism.expert"]
    assert paths({"data": 4}, backend="deepspeed") == []  # no expert axis: the family's experts as they are


def test_what_is_reached_passes():
    assert _paths({"data": 4, "expert": 4}) == []
    assert _paths({"data": 2, "tensor": 2, "context": 2, "expert": 2}) == []
    assert _paths({"data": 1}, backend="deepspeed") == []  # MoE on one process: nothing to place or sum
    for stage in (1, 2, 3):  # the experts' states and gradients over the expert-data group (native back end)
        assert _paths({"data": 4, "expert": 2}, zero={"stage": stage}) == []


def test_what_is_not_reached_is_refused_by_name():
    assert _paths({"data": 4, "expert": 2}, layers=0) == ["$.parallelism.expert"]  # no plugin MoE layer
    assert _paths({"data": 4, "expert": 2}, backend="deepspeed") == ["$.parallelism.expert"]
    assert _paths({"data": 4}, backend="accelerate") == ["$.model.moe"]  # the aux statistics need the groups
    assert _paths({"data": 2, "pipeline": 2}) == []  # each stage attaches its terms to its output (native)
    assert _paths({"data": 1, "pipeline": 2}, backend="deepspeed") == ["$.parallelism.pipeline"]
    assert _paths({"data": 2, "pipeline": 2}, model={**MODEL, "moe": {"experts": 4, "router": "sigmoid"}}) == \
        ["$.model.moe.router"]
    assert _paths({"data": 2, "tensor": 2, "expert": 2}, tensor_parallel={"sequence_parallel": True}) == []
    assert _paths({"data": 2, "tensor": 2, "expert": 2, "expert_tensor": 1}) == ["$.parallelism.expert_tensor"]
