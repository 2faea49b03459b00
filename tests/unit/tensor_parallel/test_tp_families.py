"""Every causal-LM family of the installed transformers that declares a ``base_model_tp_plan``: its tiny model (built
on the meta device, no processes) has its plan resolved at tensor 2, or is refused by name with the reason that
tests/hf_families.py records; the families trained against one process (``TP_FAMILIES``) exercise every style any of
those plans uses."""
from __future__ import annotations

import re

import pytest

from tests.dist.needs import need

need("transformers")


def _resolve(family: str):
    """``(the plan's styles, None)`` or ``(None, the error's text)``: the family's tiny model built on meta, its plan
    (``tp_plan``) resolved; the styles as the plan names them."""
    import torch
    import transformers as tf

    from plugin.errors import PluginError
    from plugin.tensor_parallel import resolve_plan
    from tests.hf_families import tiny_config, tp_plan

    try:
        config = tiny_config(family)
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(config)
    except (PluginError, KeyError, TypeError) as e:  # the three transformers' defaults raise
        return None, f"build: {type(e).__name__}: {e}"
    from plugin.tensor_parallel.auto import auto_plan

    plan = tp_plan(model, family)
    try:
        resolve_plan(model, plan, 2)
    except PluginError as e:
        return None, f"plan: {e}"
    return set((auto_plan(model) if plan == "auto" else plan).values()), None


@pytest.fixture(scope="module")
def resolved():
    from tests.hf_families import families_with_tp_plan

    return {family: _resolve(family) for family in families_with_tp_plan()}


def test_every_family_with_a_tp_plan_resolves_at_tensor_2_or_is_refused_by_name(resolved):
    from tests.hf_families import NOT_BUILT, TP_FAMILIES, TP_REFUSED

    assert len(resolved) >= 100, f"only {len(resolved)} causal-LM families with a tp plan: transformers changed"
    wrong = []
    for family, (_, error) in resolved.items():
        if family in TP_FAMILIES:  # trained against one process, with its plan as TP_FAMILIES says
            expected = None
        else:
            expected = NOT_BUILT.get(family) or TP_REFUSED.get(family)
        if expected is None and error is not None:
            wrong.append(f"{family}: refused, and hf_families records no reason: {error}")
        elif expected is not None and (error is None or expected not in error):
            wrong.append(f"{family}: expected a refusal naming {expected!r}, got {error or 'a resolved plan'}")
        elif error is not None and error.startswith("build") != (family in NOT_BUILT):
            wrong.append(f"{family}: {error}")
    assert not wrong, "\n".join(wrong)


def test_the_trained_families_exercise_every_style_of_transformers_plans(resolved):
    """Every style a family's plan names is trained by TP_FAMILIES: in the auto plans, or in their explicit entries."""
    import transformers as tf

    from plugin.tensor_parallel.styles import HF_NAMES
    from tests.hf_families import TP_FAMILIES

    used = {s for family in resolved for s in tf.CONFIG_MAPPING[family].base_model_tp_plan.values()}
    trained = set().union(*(resolved[family][0] for family in TP_FAMILIES))
    assert used <= set(HF_NAMES), f"styles the table lacks: {sorted(used - set(HF_NAMES))}"
    assert used - trained == set(), f"styles no trained family exercises: {sorted(used - trained)}"
    assert len(TP_FAMILIES) >= 12


def test_a_per_head_norm_the_family_plan_omits_is_refused_not_crashed():
    """Cohere with use_qk_norm: q_norm / k_norm are LayerNorms over [heads, head_dim] that its base plan (written for
    the default, without them) leaves whole; at tensor 2 each rank would meet half the heads with all of them (a shape
    error in the forward, found by the tensor 2 x pipeline 2 matrix). Refused before any group, by name."""
    import torch
    import transformers as tf

    from plugin.errors import PluginError
    from plugin.tensor_parallel import resolve_plan
    from tests.hf_families import tiny_config

    config = tiny_config("cohere")
    config.use_qk_norm = True
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    with pytest.raises(PluginError, match=r"'model\.layers\.0\.self_attn\.q_norm\.weight' \(\(4, 16\)\) of "
                                          r"CohereLayerNorm is per head"):
        resolve_plan(model, "auto", 2)


@pytest.mark.parametrize(("family", "kv", "tp", "refusal"), [
    ("minicpm5_moe", 1, 2, None), ("minicpm5_moe", 2, 4, None),
    ("minicpm5_moe", 2, 8, "which must share its 2 query heads (num_key_value_groups of MiniCPM5MoeAttention) whole"),
    ("llama", 2, 4, "(num_key_value_heads): 2 attention heads cannot be split whole over tensor size 4")])
def test_key_value_heads_fewer_than_ranks_are_held_whole_by_head_or_refused(family, kv, tp, refusal):
    """unit_colwise (the plugin's column_heads) holds each key/value head whole on the ranks whose query heads read
    it; a plain colwise split of them (llama's plan) cannot, nor can replicas that would cut the query heads."""
    import dataclasses

    import torch
    import transformers as tf

    from plugin.errors import PluginError
    from plugin.tensor_parallel import resolve_plan
    from tests.hf_families import TINY, tiny_config

    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(tiny_config(family, dataclasses.replace(TINY, kv_heads=kv)))
    if refusal is not None:
        with pytest.raises(PluginError, match=re.escape(refusal)):
            resolve_plan(model, "auto", tp)
        return
    styles = resolve_plan(model, "auto", tp)
    assert {n.rsplit(".", 1)[-1] for n, s in styles.items() if s.kind == "heads"} == {"k_proj", "v_proj"}
