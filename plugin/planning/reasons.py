"""Why each planned layout is where it is: words for the step-time terms that set it apart (pure).

:func:`explain` gives the first plan its largest overhead and every other plan the term that costs it most
against the first, with the numbers behind it (used by :func:`plugin.planning.search.plan`).
"""
from __future__ import annotations

import dataclasses

from .dims import ModelSpec
from .schedule import bubble_fraction
from .steptime import group_inside_node
from .units import fmt_gb, fmt_seconds


def _term_detail(name: str, plan, spec: ModelSpec, gpus_per_node: int) -> str:
    """Words for one step-time term of a plan, with the numbers behind it."""
    s = plan.setup
    if name == "compute":
        if s.pp > 1 and spec.layers % s.pp:
            return (f"uneven pipeline stages ({spec.layers_on_stage(0, s.pp)} blocks on the first stage, "
                    f"{spec.layers / s.pp:.1f} on average)")
        if s.pp > 1:
            return "the output layer, which the last pipeline stage computes on top of its blocks"
        return "more compute per GPU"
    if name == "recompute":
        return f"{s.recompute} recompute repeats the forward pass"
    if name == "tensor_communication":
        where = "inside a node" if group_inside_node("tensor", s, gpus_per_node) else "across nodes"
        return f"tensor-parallel all-reduces over {s.tp} ranks {where}, 4 per block per micro-batch"
    if name == "context_communication":
        kind = "the K/V ring" if s.cp_method == "ring" else "the attention's all-to-alls"
        where = "inside a node" if group_inside_node("context", s, gpus_per_node) else "across nodes"
        hidden = ", the part the attention's compute does not hide" if s.cp_method == "ring" else ""
        return f"{kind} over {s.cp} context ranks {where}{hidden}"
    if name == "expert_communication":
        return (f"the MoE dispatch's all-to-alls over {s.ep} expert ranks, 2 forward and 2 backward per MoE block "
                "per micro-batch")
    if name == "pipeline_bubble":
        return (f"the pipeline bubble, (p-1)/m = {s.pp - 1}/{s.micro_batches} = "
                f"{bubble_fraction(s.pp, s.micro_batches):.0%}")
    if name == "pipeline_p2p":
        return f"activation sends between {s.pp} pipeline stages"
    if name == "data_parallel_exposed":
        kind = {0: "gradient all-reduce", 1: "ZeRO-1 gradient reduction and weight gather",
                2: "ZeRO-2 per-micro-batch reductions and weight gather", 3: "ZeRO-3 parameter gathers"}[s.zero_stage]
        over = f"{s.dp} x context {s.cp} = {s.replicas}" if s.cp > 1 else f"{s.dp}"
        return f"the {kind} over {over} ranks, which DeepSpeed does not overlap with compute"
    if name == "embedding_allreduce":
        return "the tied embedding's gradient all-reduce between the first and last pipeline stage"
    if name == "optimizer_step":
        return "the optimizer step over a larger shard"
    return name


def explain(plans: list, usable: float, spec: ModelSpec, gpus_per_node: int) -> list:
    """Give each plan its rank and the reason for its place (against #1)."""
    if not plans:
        return []
    first = plans[0]
    out = []
    for i, p in enumerate(plans, start=1):
        share = {k: v / p.time.total for k, v in p.time.terms}
        if i == 1:
            overhead = max((k for k in share if k != "compute"), key=lambda k: share[k])
            reason = (f"fastest: compute is {share['compute']:.0%} of the step; the largest overhead is "
                      f"{_term_detail(overhead, p, spec, gpus_per_node)} ({share[overhead]:.0%})")
        else:
            delta = p.time.total - first.time.total
            if delta <= 1e-3 * first.time.total:
                more = p.memory.total - first.memory.total
                reason = (f"as fast as #1 in this model; ranked below it for using {fmt_gb(more)} more memory"
                          if more > 0 else "as fast as #1 in this model")
            else:
                diffs = {k: v - first.time.get(k) for k, v in p.time.terms}
                worst = max(diffs, key=lambda k: diffs[k])
                detail = _term_detail(worst, p, spec, gpus_per_node)
                reason = (f"{delta / first.time.total:+.1%} step time, mostly {detail} "
                          f"(+{fmt_seconds(diffs[worst])})")
        if p.setup.recompute != "none" and all(q.setup.recompute != "none" for q in plans):
            reason += "; recompute is needed to fit"
        reason += f"; {fmt_gb(usable - p.memory.total)} headroom"
        out.append(dataclasses.replace(p, rank=i, reason=reason))
    return out
