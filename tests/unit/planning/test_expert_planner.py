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


def test_plan_refuses_a_moe_recipe_by_name_with_the_way_round_it(tmp_path):
    """A MoE recipe validates, and plan does not rank MoE layouts yet: it says so (not "unknown key 'moe'")."""
    import json

    from plugin.errors import RecipeError
    from plugin.planning.presets import resolve_model
    from plugin.recipe.checks import load_recipe
    from plugin.recipe.load import find_recipe

    data = json.loads(find_recipe("cpu_dp4").read_text())
    data.pop("$schema", None)
    data["model"]["moe"] = {"experts": 8, "top_k": 2, "every": 2, "ffn_hidden": 64}
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(data))
    assert load_recipe(str(path)).model.moe is not None
    with pytest.raises(RecipeError) as caught:
        resolve_model(path)
    text = str(caught.value)
    assert "$.model.moe: plan does not search the layouts of a mixture-of-experts model yet" in text, text
    assert "python -m plugin estimate RECIPE.json" in text and "unknown key" not in text, text
