"""The planner knows the expert axis: per-rank parameters and optimizer states of a MoE model at E = 1, 2, 4
against the reference GPT's real parameters (experts / E), the experts' ZeRO shards over the expert-data group,
and the all-to-all bytes per MoE block (forward and backward, top_k x tokens x hidden)."""
from __future__ import annotations

import pytest

from plugin.planning.dims import ModelSpec
from plugin.planning.memory import expected_model_states
from plugin.planning.setup import Setup
from plugin.planning.steptime import step_time
from plugin.planning.traffic import communication_per_rank

SPEC = ModelSpec(layers=4, hidden=64, heads=4, vocab=128, seq_len=64, ffn_hidden=256, tied_embeddings=False,
                 moe_experts=8, moe_top_k=2, moe_every=2, moe_ffn_hidden=96)


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_per_rank_parameters_match_the_reference_gpt(ep):
    from plugin.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab=128, hidden=64, layers=4, heads=4, seq_len=64, ffn_hidden=256, moe_experts=8,
                          moe_top_k=2, moe_every=2, moe_ffn_hidden=96))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    rest = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    assert SPEC.total_params() == experts + rest
    assert SPEC.stage_params(0, ep=ep) == rest + experts / ep
    assert SPEC.stage_expert_params(0, ep=ep) == experts / ep


def test_expert_optimizer_states_shard_over_the_expert_data_group():
    experts = SPEC.stage_expert_params(0)
    dense = SPEC.total_params() - experts
    for zero in (0, 1):
        setup = Setup(dp=8, ep=4, zero_stage=zero, precision="fp32")
        p, _, k = setup.state_bytes()
        states = expected_model_states(SPEC, setup)
        assert states.parameters == p * (dense + experts / 4)
        # ZeRO-1: the dense states over data 8, each rank's experts' states over its expert-data group of 8 / 4 = 2
        want = k * (dense + experts / 4) if zero == 0 else k * (dense / 8 + experts / 4 / 2)
        assert states.optimizer_states == pytest.approx(want)


def test_all_to_all_bytes_per_moe_block():
    setup = Setup(dp=8, ep=4, micro_batch=2, micro_batches=3, precision="bf16")
    terms = {t.name: t for t in communication_per_rank(SPEC, setup)}
    a2a = terms["expert_all_to_all"]
    tokens = 64 * 2
    assert a2a.group == "expert"
    # 2 MoE blocks x 3 micro-batches x 4 all-to-alls (2 forward, 2 backward) x 3/4 leaving x k tokens h bf16
    assert a2a.bytes == 2 * 3 * 4 * 0.75 * 2 * tokens * 64 * 2
    assert terms["expert_gradient_allreduce"].group == "expert_data"
    assert "expert_all_to_all" not in {t.name for t in communication_per_rank(SPEC, Setup(dp=8))}
    assert dict(step_time(SPEC, setup).terms)["expert_communication"] > 0


def _moe_recipe_file(tmp_path, moe: dict):
    import json

    from plugin.recipe.load import find_recipe

    data = json.loads(find_recipe("cpu_dp4").read_text())
    data.pop("$schema", None)
    data["model"]["moe"] = moe
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(data))
    return path


def test_plan_reads_a_moe_recipes_model_and_refuses_its_bad_moe_block_as_validate_does(tmp_path):
    """``plan --model RECIPE.json`` of a MoE recipe reads its moe block (with the settings that count nothing, so a
    written recipe keeps them); a block the recipe refuses is refused at the same place."""
    from plugin.errors import RecipeError
    from plugin.planning.presets import resolve_model

    spec = resolve_model(_moe_recipe_file(tmp_path, {"experts": 8, "top_k": 2, "every": 2, "ffn_hidden": 64,
                                                     "router": "sigmoid"}))
    assert (spec.moe_experts, spec.moe_top_k, spec.moe_every, spec.moe_ffn_hidden) == (8, 2, 2, 64)
    assert spec.to_model_block()["moe"] == {"experts": 8, "top_k": 2, "every": 2, "ffn_hidden": 64,
                                            "router": "sigmoid"}
    for moe, where in (({"experts": 8, "top_k": 9}, "$.model.moe.top_k"), ({"experts": 0}, "$.model.moe.experts"),
                       ({"experts": 8, "router": "cosine"}, "$.model.moe.router"), ({"top_k": 2}, "$.model.moe")):
        with pytest.raises(RecipeError) as caught:
            resolve_model(_moe_recipe_file(tmp_path, moe))
        assert where in str(caught.value), (moe, str(caught.value))


def test_plan_searches_the_expert_degree_and_writes_the_recipe_estimate_agrees_with(tmp_path, capsys):
    """A MoE model too large for data parallelism alone: the plan that fits places its experts over E > 1 ranks, and
    --write writes "expert" and the moe
    block; plan checks that estimate of the written recipe gives its memory and step time."""
    import json

    from plugin.cli.main import main
    from plugin.planning.search import plan

    big = {"layers": 8, "hidden": 2048, "heads": 16, "vocab": 32000, "seq_len": 2048,
           "moe": {"experts": 64, "top_k": 2, "every": 1, "ffn_hidden": 4096, "aux_loss_coef": 0.02}}
    model = tmp_path / "big.json"
    model.write_text(json.dumps(big))
    from plugin.planning.presets import resolve_model

    result = plan(resolve_model(model), 16, 40e9, global_batch=2048, top=50, as_recipe=True)
    setups = [p.setup for p in result.plans]
    assert {s.ep for s in setups} >= {2, 4, 8}
    assert setups[0].ep > 1, [s.label() for s in setups[:5]]
    written = tmp_path / "plan.json"
    assert main(["plan", "--model", str(model), "--gpus", "16", "--gpu-memory", "40", "--write", str(written)]) == 0
    out = capsys.readouterr().out
    assert "expert" in out and "gives the same memory and step time (checked)" in out, out
    data = json.loads(written.read_text())
    assert data["parallelism"]["expert"] == setups[0].ep and data["model"]["moe"] == big["moe"], data
    assert data["launcher"] == "auto"  # which trains an expert axis on the native back end
