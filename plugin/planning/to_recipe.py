"""The planner's winner as a recipe, and the check that ``estimate`` of that recipe agrees with the plan (pure).

A plan is written only if it was ranked as the model the recipe describes (``plan(..., as_recipe=True)``):
a recipe's ``model`` block carries dimensions and dropout but no architecture (MLP kind, norm, tied
embeddings), so the engine builds its reference GPT from it, and ``estimate`` counts that model. After
writing, :func:`check_written_recipe` re-estimates the recipe as ``estimate`` would and names every
disagreement with the plan (fit, memory, step time): the CLI refuses to write a recipe with any.
"""
from __future__ import annotations

import math
import re

from .units import fmt_gb, fmt_seconds


def to_recipe_data(plan_, result, name: str = "") -> dict:
    """A recipe (JSON data) for a plan: degrees, ZeRO stage, batch, memory savers, model and cluster.

    A context degree above 1 is written as ``"context"`` in ``parallelism`` with its ``context_parallel.method``;
    ``"launcher": "auto"`` then trains it on the native back end (the DeepSpeed back end has no context axis). An
    expert degree above 1 is written as ``"expert"`` (the model block carries its ``moe`` block); ``"auto"`` trains it
    on the native back end too.

    Recompute is written as ``activation_checkpointing`` (``{"mode": "full", "every": k}``, or ``{"mode":
    "selective"}``). The model block carries the dimensions and dropout; the cluster is the planned one,
    whole nodes (``result.gpus`` is one node's share or a multiple of ``gpus_per_node``: :func:`plugin.
    planner.plan` refuses anything else). Raises ValueError for a plan ranked for a model a recipe cannot
    describe (plan with ``as_recipe=True``).
    """
    s, spec = plan_.setup, result.spec
    if not spec.is_recipe_model():
        raise ValueError(f"{spec.name} has an architecture a recipe's model block cannot state "
                         f"({', '.join(spec.as_recipe_model().architecture_differences(spec))} in the recipe's "
                         f"reference GPT): plan with as_recipe=True to rank the model the recipe describes")
    name = name or f"plan_{spec.name}_{result.gpus}gpus"
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "plan"
    per_node = min(result.gpus, result.gpus_per_node)
    assert result.gpus % per_node == 0, "plan() refuses GPUs that do not fill whole nodes"
    data: dict = {
        "name": name,
        "description": (f"Planned by `python -m plugin plan` for {(result.requested or spec).name} on "
                        f"{result.gpus} x {fmt_gb(result.gpu_memory, 0)}: {fmt_gb(plan_.memory.total)} per GPU, "
                        f"step about {fmt_seconds(plan_.time.total)} ({result.hardware.name} roofline)."),
        "parallelism": {"data": s.dp, "tensor": s.tp, "pipeline": s.pp},
        "zero": {"stage": s.zero_stage},
    }
    if s.cp > 1:  # left out at 1, as the recipe's default: plans without the axis write what they always wrote
        data["parallelism"]["context"] = s.cp
        data["context_parallel"] = {"method": s.cp_method}
    if s.ep > 1:  # the experts over ep ranks of data x context; "launcher": "auto" trains them on the native back end
        data["parallelism"]["expert"] = s.ep
    if s.tp > 1:
        data["tensor_parallel"] = {"sequence_parallel": s.sequence_parallel, "plan": "auto"}
    if s.pp > 1:
        data["pipeline_parallel"] = {"schedule": s.schedule}
    if s.recompute == "full":
        data["activation_checkpointing"] = {"mode": "full", "every": s.checkpoint_interval}
    elif s.recompute == "selective":
        data["activation_checkpointing"] = {"mode": "selective"}
    data["batch"] = {"global": s.global_batch, "micro": s.micro_batch}
    data["precision"] = s.precision
    data["optimizer"] = {"name": "adamw", "lr": 0.0003, "weight_decay": 0.1, "betas": [0.9, 0.95]}
    data["gradient_clipping"] = 1.0
    data["model"] = spec.to_model_block()
    data["cluster"] = {"nodes": result.gpus // per_node, "gpus_per_node": per_node,
                       "gpu_memory_gb": result.gpu_memory / 1e9}
    data["launcher"] = "auto"
    return data


def check_written_recipe(recipe, plan_, result) -> list[str]:
    """Where ``estimate`` of the written ``recipe`` disagrees with the plan it came from ([] if nowhere).

    The recipe is estimated exactly as ``python -m plugin estimate`` does (its own cluster's GPU memory and
    gpus_per_node); its context degree and method must be the plan's, its memory and step time must equal the
    plan's, and it must fit.
    """
    from .for_recipe import estimate_recipe

    est = estimate_recipe(recipe, hardware=result.hardware)
    out = []
    s, par = plan_.setup, recipe.parallelism
    written = (par.context, recipe.context_parallel.method if par.context > 1 else "ring")
    if written != (s.cp, s.cp_method):
        out.append(f"the recipe says context {written[0]} ({written[1]}), the plan context {s.cp} ({s.cp_method})")
    if est.setup != plan_.setup:
        out.append(f"estimate reads the layout as {est.setup.label()}, the plan is {plan_.setup.label()}")
    read, ranked = _model_json(est.spec), _model_json(result.spec)
    if read != ranked:
        diff = {k: (read[k], ranked[k]) for k in read if read[k] != ranked[k]}
        out.append(f"estimate reads the model differently (estimate, plan): {diff}")
    if not math.isclose(est.memory.total, plan_.memory.total, rel_tol=1e-9):
        out.append(f"estimate counts {fmt_gb(est.memory.total, 3)} per GPU, the plan {fmt_gb(plan_.memory.total, 3)}")
    if not math.isclose(est.time.total, plan_.time.total, rel_tol=1e-9):
        out.append(f"estimate times a step at {fmt_seconds(est.time.total)}, "
                   f"the plan at {fmt_seconds(plan_.time.total)}")
    if not est.fits:
        out.append(f"estimate says it does not fit: {fmt_gb(est.memory.total)} of {fmt_gb(est.usable)} usable")
    return out


def _model_json(spec) -> dict:
    """A model's resolved dimensions and architecture, without its name."""
    out = spec.to_json()
    out.pop("name"), out.pop("source")
    return out
