"""What the expert axis reaches today, checked before any process group: the reference GPT's MoE layers
(:class:`.layer.MoE`) on the native back end at ZeRO 0-3 (DDP, ZeroRedundancyOptimizer, FSDP2: the experts over the
expert-data group), with tensor and context parallelism, and pipeline stages (softmax router). Everything else with
an expert axis (or with MoE layers whose load-balancing statistics need the groups) is refused by name here, so that
nothing trains differently from one process."""
from __future__ import annotations

from ..errors import Problem


def moe_native_only(router: str | None, expert: int, data_ranks: int | None, pipeline: int = 1) -> dict[str, str]:
    """What of MoE layers only the native back end reaches (empty: any back end), the one statement of that rule:
    ``"router"`` for the sigmoid router (its bias update after each step), ``"spread"`` for layers over more than one
    data rank (``expert`` > 1, or ``data_ranks`` = data x context above 1, or None: ``"auto"``, known at the launch),
    whose expert groups and load-balancing statistics :mod:`plugin.expert_parallel` builds on the native back end,
    ``"pipeline"`` for layers in pipeline stages (``pipeline`` > 1), whose terms reach the loss there.
    :func:`plugin.engines.choose.native_only` picks the back end by it, :func:`check_expert_reach` refuses the
    others by it."""
    out = {}
    if router == "sigmoid":
        out["router"] = "MoE layers with the sigmoid router: its bias update is the native back end's"
    if expert > 1 or data_ranks is None or data_ranks > 1:
        out["spread"] = ("MoE layers over more than one data rank: their expert groups and balancing are the native "
                         "back end's")
    if pipeline > 1:
        out["pipeline"] = ("MoE layers in pipeline stages: the terms each stage attaches to its output are the native "
                           "back end's")
    return out


def check_expert_reach(recipe, layout, backend: str, moe_layers: int, family: str | None = None,
                       ep_plan: bool = False, hf_layers: int = 0, router_logits: bool = False) -> list[Problem]:
    """Problems (JSON path, what, fix) for ``recipe`` at ``layout`` on ``backend``, the model holding ``moe_layers``
    plugin MoE layers and ``hf_layers`` transformers experts modules the dispatch drives (:mod:`.hf`); ``family``: a
    transformers model's ``model_type`` (``ep_plan``: whether its config declares a ``base_model_ep_plan``;
    ``router_logits``: whether it adds its load-balancing loss, ``output_router_logits``), named in the refusals."""
    e, out = layout.expert, []
    if e > 1 and moe_layers == 0 and hf_layers == 0:
        what = "the model has no MoE layer the plugin can place (the reference GPT's model.moe)"
        if family:
            what = (f"the transformers family {family!r} " + ("declares a base_model_ep_plan, but " if ep_plan else
                    "declares no base_model_ep_plan, and ") + "has no experts module that takes (hidden_states, "
                    "top_k_index, top_k_weights) with its weights stacked by expert, the one the plugin places")
        out.append(Problem("$.parallelism.expert", f"expert {e}: {what}", 'set "expert": 1 (experts under tensor '
                           'parallelism and ZeRO), or use the reference GPT with "model": {"moe": {...}}, or a '
                           "transformers MoE family (train.py --model mixtral)"))
    if e > 1 and hf_layers:
        out += _hf_reach(layout, backend, family or "transformers", router_logits)
    if moe_layers == 0:
        return out
    moe = recipe.model.moe if recipe.model is not None else None
    native = {} if backend == "native" else moe_native_only(moe.router if moe is not None else None, e,
                                                              layout.data * layout.context, layout.pipeline)
    if "spread" in native:
        out.append(Problem("$.parallelism.expert" if e > 1 else "$.model.moe", f"MoE layers on the {backend} back end "
                           "over more than one data rank: its expert groups and the load-balancing statistics over "
                           "data x context are not reached there yet", 'use the native back end ("launcher": '
                           '"torchrun")'))
    if "router" in native:
        out.append(Problem("$.model.moe.router", f'the "sigmoid" router on the {backend} back end: its bias update '
                           "after each step is the native back end's (not reached there yet)",
                           'use the native back end ("launcher": "torchrun"), or "router": "softmax"'))
    if "pipeline" in native:
        out.append(Problem("$.parallelism.pipeline", f"MoE layers with pipeline {layout.pipeline} on the {backend} "
                           "back end: the load-balancing terms of stages before the last would not reach the loss "
                           "there (the native back end attaches them to each stage's output)",
                           'use the native back end ("launcher": "torchrun"), or "pipeline": 1'))
    elif layout.pipeline > 1 and moe is not None and moe.router == "sigmoid":
        out.append(Problem("$.model.moe.router", f'the "sigmoid" router with pipeline {layout.pipeline}: the schedule '
                           "runs its first micro-batch once more to learn the shapes, which would count its loads "
                           "twice in the bias update (not reached yet)", 'use "router": "softmax", or "pipeline": 1'))
    if e > 1 and layout.tensor > 1 and layout.expert_tensor_resolved == 1:
        out.append(Problem("$.parallelism.expert_tensor", "whole experts (expert_tensor 1) with tensor "
                           f"{layout.tensor}: the tensor ranks' copies of each token would reach the experts twice "
                           "(not reached yet)",
                           'drop "expert_tensor" (experts split over the tensor group)'))
    return out


def _hf_reach(layout, backend: str, family: str, router_logits: bool) -> list[Problem]:
    """What the expert axis does not reach yet with a transformers family's experts (:mod:`.hf`)."""
    e, out = layout.expert, []
    if "spread" in moe_native_only(None, e, layout.data * layout.context) and backend != "native":
        out.append(Problem("$.parallelism.expert", f"{family}'s experts over expert {e} on the {backend} back end: "
                           "its expert groups are not reached there yet", 'use the native back end ("launcher": '
                           '"torchrun")'))
    if layout.pipeline > 1:
        out.append(Problem("$.parallelism.pipeline", f"{family}'s experts over expert {e} with pipeline "
                           f"{layout.pipeline}: not reached yet", 'use "pipeline": 1 with an expert axis'))
    if layout.tensor > 1:
        out.append(Problem("$.parallelism.tensor", f"{family}'s experts over expert {e} with tensor {layout.tensor}: "
                           "each expert's columns over the tensor group are not reached yet with an expert axis",
                           'use "tensor": 1 with an expert axis, or "expert": 1 (the family\'s plan splits each '
                           "expert over the tensor group)"))
    if router_logits and layout.data * layout.context > 1:
        out.append(Problem("$.parallelism.expert", f"{family} adds its load-balancing loss (output_router_logits), "
                           "which transformers computes over each rank's tokens, not over the micro-batch of every "
                           "data rank as one process does", "set the config's output_router_logits to False, or use "
                           'the reference GPT with "model": {"moe": {...}} (its balance over every data rank)'))
    return out
