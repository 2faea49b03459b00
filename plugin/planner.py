"""Find the fastest layout that fits: enumerate, estimate, rank, explain (pure).

Every layout of ``gpus`` = tensor x pipeline x data is tried with each ZeRO stage (2 and 3 only without
pipeline parallelism, as DeepSpeed requires), sequence parallelism on and off (tensor > 1), each
recompute mode and every micro-batch size that divides the per-replica batch; each layout is ranked at
its fastest micro-batch (so the top K are K different layouts, not one layout's micro-batch sizes).
A layout is valid when the tensor size divides heads, kv_heads, hidden and ffn_hidden, the pipeline has
no more stages than layers, and the data size divides the global batch. Those whose most loaded rank
fits in the usable memory (:func:`plugin.estimate.usable_memory`) are ranked by
:func:`plugin.steptime.step_time`, ties by memory.

Tensor groups stay inside a node: layouts whose tensor groups would cross nodes are tried only when no
other fits, and the result says so. Memory grows with the micro-batch size, so the search stops at the
first micro-batch that does not fit; 512 GPUs take well under a second.

The recompute modes default to what a recipe can say: ``none`` and ``full`` (``pipeline_parallel.
activation_checkpoint_interval`` = 1). ``selective`` is estimated but has no recipe field yet. Attention
is taken as fused (FlashAttention) and dropout as on (its masks counted), the conservative choice.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .dims import ModelSpec, params_text
from .estimate import Breakdown, Setup, bubble_fraction, memory_per_rank, usable_memory
from .steptime import HARDWARE, Hardware, StepTime, group_inside_node, step_time
from .units import fmt_gb, fmt_seconds

DEFAULT_TOKENS_PER_BATCH = 2**22  # about 4M tokens, the batch Llama 2 trained with
RECIPE_RECOMPUTE = ("none", "full")


@dataclass(frozen=True)
class Plan:
    """One ranked layout with its estimates and the reason for its place."""

    setup: Setup
    memory: Breakdown
    time: StepTime
    rank: int = 0
    reason: str = ""

    def to_json(self) -> dict:
        return {"rank": self.rank, "layout": self.setup.to_json(), "label": self.setup.label(),
                "memory": self.memory.to_json(), "time": self.time.to_json(), "reason": self.reason}


@dataclass(frozen=True)
class PlanResult:
    """What :func:`plan` found: the ranked plans (best first), or why none fits."""

    spec: ModelSpec
    gpus: int
    gpus_per_node: int
    gpu_memory: float
    global_batch: int
    hardware: Hardware
    plans: tuple[Plan, ...]
    considered: int
    fitting: int
    notes: tuple[str, ...] = ()
    closest: Optional[Plan] = None  # the least-memory layout, when nothing fits
    advice: str = ""

    @property
    def usable(self) -> float:
        return usable_memory(self.gpu_memory)[0]

    @property
    def reserve(self) -> float:
        return usable_memory(self.gpu_memory)[1]

    def to_json(self) -> dict:
        return {
            "model": self.spec.to_json(),
            "gpus": self.gpus, "gpus_per_node": self.gpus_per_node,
            "gpu_memory": self.gpu_memory, "usable_memory": self.usable, "reserve": self.reserve,
            "global_batch": self.global_batch, "tokens_per_step": self.global_batch * self.spec.seq_len,
            "hardware": self.hardware.to_json(),
            "considered": self.considered, "fitting": self.fitting,
            "notes": list(self.notes), "advice": self.advice,
            "plans": [p.to_json() for p in self.plans],
            "closest": self.closest.to_json() if self.closest else None,
        }


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def default_global_batch(gpus: int, seq_len: int) -> int:
    """About 4M tokens, rounded to a multiple of ``gpus`` (so every data size divides it)."""
    target = max(1, DEFAULT_TOKENS_PER_BATCH // seq_len)
    return gpus * max(1, round(target / gpus))


def tensor_sizes(spec: ModelSpec, gpus: int) -> list[int]:
    """Tensor sizes that divide the GPUs and the heads, kv_heads, hidden and ffn sizes."""
    return [t for t in divisors(gpus)
            if not (spec.heads % t or spec.kv % t or spec.hidden % t or spec.ffn % t)]


@dataclass
class _Search:
    spec: ModelSpec
    gpus: int
    gpus_per_node: int
    usable: float
    global_batch: int
    hardware: Hardware
    precision: str
    recompute_modes: Sequence[str]
    considered: int = 0
    fits: list = field(default_factory=list)  # (time, memory, counter, Setup, Breakdown, StepTime)
    smallest: Optional[tuple] = None  # (memory, Setup, Breakdown) of the least-memory layout tried

    def run(self, cross_node: bool) -> None:
        for tp in tensor_sizes(self.spec, self.gpus):
            for pp in divisors(self.gpus // tp):
                if pp > self.spec.layers:
                    continue
                dp = self.gpus // (tp * pp)
                if self.global_batch % dp:
                    continue
                inside = group_inside_node("tensor", Setup(tp=tp, pp=pp, dp=dp), self.gpus_per_node)
                if inside != cross_node:
                    self._layouts(tp, pp, dp)

    def _layouts(self, tp: int, pp: int, dp: int) -> None:
        per_replica = self.global_batch // dp
        micro_sizes = divisors(per_replica)
        stages = [0] if dp == 1 else ([0, 1] if pp > 1 else [0, 1, 2, 3])
        sps = [False, True] if tp > 1 and self.spec.seq_len % tp == 0 else [False]
        for zero in stages:
            for sp in sps:
                for mode in self.recompute_modes:
                    best = None  # this layout at its fastest micro-batch
                    for mb in micro_sizes:
                        setup = Setup(tp=tp, pp=pp, dp=dp, zero_stage=zero, micro_batch=mb,
                                      micro_batches=per_replica // mb, recompute=mode, sequence_parallel=sp,
                                      precision=self.precision)
                        self.considered += 1
                        memory = memory_per_rank(self.spec, setup)
                        if self.smallest is None or memory.total < self.smallest[0]:
                            self.smallest = (memory.total, setup, memory)
                        if memory.total > self.usable:
                            break  # memory grows with the micro-batch: larger ones fit even less
                        time = step_time(self.spec, setup, self.hardware, self.gpus_per_node)
                        entry = (time.total, memory.total, len(self.fits), setup, memory, time)
                        best = entry if best is None or entry[:2] < best[:2] else best
                    if best is not None:
                        self.fits.append(best)


def plan(spec: ModelSpec, gpus: int, gpu_memory: float, *, gpus_per_node: int = 8,
         global_batch: Optional[int] = None, top: int = 5, hardware: Hardware = HARDWARE["h100"],
         precision: str = "bf16", recompute_modes: Sequence[str] = RECIPE_RECOMPUTE) -> PlanResult:
    """Rank every valid layout of ``spec`` on ``gpus`` accelerators of ``gpu_memory`` bytes each."""
    if gpus < 1 or gpus_per_node < 1 or top < 1:
        raise ValueError(f"gpus, gpus_per_node and top must be >= 1, got {gpus}, {gpus_per_node}, {top}")
    batch = global_batch if global_batch is not None else default_global_batch(gpus, spec.seq_len)
    usable, reserve = usable_memory(gpu_memory)
    search = _Search(spec, gpus, gpus_per_node, usable, batch, hardware, precision, tuple(recompute_modes))
    search.run(cross_node=False)
    notes: list[str] = []
    if not search.fits:
        search.run(cross_node=True)
        if search.fits:
            notes.append(f"no layout with tensor groups inside a node ({gpus_per_node} GPUs) fits; these "
                         f"split tensor groups across nodes, whose all-reduces go over InfiniBand")
    best = heapq.nsmallest(top, search.fits)
    plans = _explain([Plan(setup=s, memory=m, time=t) for _, _, _, s, m, t in best], usable, spec,
                     gpus_per_node)
    result = PlanResult(spec=spec, gpus=gpus, gpus_per_node=gpus_per_node, gpu_memory=gpu_memory,
                        global_batch=batch, hardware=hardware, plans=tuple(plans), considered=search.considered,
                        fitting=len(search.fits), notes=tuple(notes))
    if plans:
        return result
    return _nothing_fits(result, search, usable, reserve)


# ------------------------------------------------------------------ reasons
def _term_detail(name: str, plan: Plan, spec: ModelSpec, gpus_per_node: int) -> str:
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
        where = "inside a node" if is_tensor_inside_node(s, gpus_per_node) else "across nodes"
        return f"tensor-parallel all-reduces over {s.tp} ranks {where}, 4 per block per micro-batch"
    if name == "pipeline_bubble":
        return (f"the pipeline bubble, (p-1)/m = {s.pp - 1}/{s.micro_batches} = "
                f"{bubble_fraction(s.pp, s.micro_batches):.0%}")
    if name == "pipeline_p2p":
        return f"activation sends between {s.pp} pipeline stages"
    if name == "data_parallel_exposed":
        kind = {0: "gradient all-reduce", 1: "ZeRO-1 gather of the updated weights",
                2: "ZeRO-2 reduce-scatters and weight gather", 3: "ZeRO-3 parameter gathers"}[s.zero_stage]
        return f"the {kind} over {s.dp} ranks, where compute cannot hide it"
    if name == "optimizer_step":
        return "the optimizer step over a larger shard"
    return name


def _explain(plans: list[Plan], usable: float, spec: ModelSpec, gpus_per_node: int) -> list[Plan]:
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
        out.append(Plan(setup=p.setup, memory=p.memory, time=p.time, rank=i, reason=reason))
    return out


# ------------------------------------------------------------------ nothing fits
def _nothing_fits(result: PlanResult, search: _Search, usable: float, reserve: float) -> PlanResult:
    from dataclasses import replace

    spec, gpus = result.spec, result.gpus
    if search.smallest is None:
        batch = -(-result.global_batch // gpus) * gpus
        advice = (f"no layout of {gpus} GPUs is valid for {spec.name}: the data size must divide the global "
                  f"batch {result.global_batch}, the tensor size must divide heads {spec.heads}, kv_heads "
                  f"{spec.kv}, hidden {spec.hidden} and ffn {spec.ffn}, and there can be no more pipeline "
                  f"stages than the {spec.layers} layers. Try --global-batch {batch} (a multiple of {gpus}), "
                  f"or a GPU count with more divisors")
        return replace(result, advice=advice)
    need, setup, memory = search.smallest
    short = need - usable
    more_gpus = _gpus_that_fit(spec, gpus, result.gpus_per_node, usable, result.hardware, search.precision,
                               search.recompute_modes)
    options = [f"accelerators with at least {fmt_gb(need + reserve, 0)} each"]
    if more_gpus:
        options.append(f"{more_gpus} GPUs (the smallest power-of-two multiple of {gpus} where a layout fits)")
    options.append("a shorter --seq-len, or a smaller model")
    options.append("offloading optimizer states to the CPU (zero.offload_optimizer; not planned, but "
                   "`estimate` counts it)")
    advice = (f"nothing fits in {fmt_gb(usable)} usable per GPU ({fmt_gb(result.gpu_memory)} less a "
              f"{fmt_gb(reserve)} reserve): the layout needing the least memory, {setup.label()}, needs "
              f"{fmt_gb(need)} per GPU, {fmt_gb(short)} too much. Use " + "; or ".join(options) + ".")
    closest = Plan(setup=setup, memory=memory, time=step_time(spec, setup, result.hardware, result.gpus_per_node))
    return replace(result, closest=closest, advice=advice)


def _gpus_that_fit(spec: ModelSpec, gpus: int, gpus_per_node: int, usable: float, hardware: Hardware,
                   precision: str, modes: Sequence[str]) -> Optional[int]:
    """The smallest gpus x 2^k (k <= 10) where some layout fits, at micro-batch 1; None if none."""
    for k in range(1, 11):
        n = gpus * 2**k
        for tp in tensor_sizes(spec, n):
            for pp in divisors(n // tp):
                if pp > spec.layers:
                    continue
                dp = n // (tp * pp)
                zero = 3 if (pp == 1 and dp > 1) else (1 if dp > 1 else 0)
                setup = Setup(tp=tp, pp=pp, dp=dp, zero_stage=zero, micro_batch=1, micro_batches=max(pp, 1),
                              recompute=modes[-1], sequence_parallel=tp > 1 and spec.seq_len % tp == 0,
                              precision=precision)
                if memory_per_rank(spec, setup).total <= usable:
                    return n
    return None


def describe_result(result: PlanResult) -> str:
    """One line on what was searched: model, GPUs, batch, hardware assumptions."""
    spec = result.spec
    nodes = max(1, math.ceil(result.gpus / result.gpus_per_node))
    return (f"{spec.name} ({params_text(spec.total_params())} parameters, seq {spec.seq_len}) on {result.gpus} "
            f"GPUs ({nodes} node{'s' if nodes > 1 else ''} of {min(result.gpus, result.gpus_per_node)}), "
            f"{fmt_gb(result.gpu_memory, 0)} each ({fmt_gb(result.usable)} usable); global batch "
            f"{result.global_batch} sequences = {_tokens(result.global_batch * spec.seq_len)} tokens; "
            f"{result.hardware.describe()}")


def _tokens(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def is_tensor_inside_node(setup: Setup, gpus_per_node: int) -> bool:
    return group_inside_node("tensor", setup, gpus_per_node)


# ------------------------------------------------------------------ the winner as a recipe
def to_recipe_data(plan_: Plan, result: PlanResult, name: str = "") -> dict:
    """A recipe (JSON data) for a plan: degrees, ZeRO stage, batch, memory savers, model and cluster.

    Full recompute is written as ``pipeline_parallel.activation_checkpoint_interval: 1`` (a checkpoint at
    every block). The model block carries the dimensions only: a recipe has no field for the MLP kind,
    norm or embeddings tying, so an engine builds its reference GPT from it (see :mod:`plugin.dims`).
    """
    import re

    s, spec = plan_.setup, result.spec
    if s.recompute == "selective":
        raise ValueError("a recipe has no field for selective recompute; plan with recompute_modes "
                         "('none', 'full') to write one")
    name = name or f"plan_{spec.name}_{result.gpus}gpus"
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "plan"
    nodes = max(1, math.ceil(result.gpus / result.gpus_per_node))
    data: dict = {
        "name": name,
        "description": (f"Planned by `python -m plugin plan` for {spec.name} on {result.gpus} x "
                        f"{fmt_gb(result.gpu_memory, 0)}: {fmt_gb(plan_.memory.total)} per GPU, "
                        f"step about {fmt_seconds(plan_.time.total)} ({result.hardware.name} roofline)."),
        "parallelism": {"data": s.dp, "tensor": s.tp, "pipeline": s.pp},
        "zero": {"stage": s.zero_stage},
    }
    if s.tp > 1:
        data["tensor_parallel"] = {"sequence_parallel": s.sequence_parallel, "plan": "auto"}
    if s.pp > 1 or s.recompute == "full":
        block: dict = {"schedule": s.schedule}
        if s.recompute == "full":
            block["activation_checkpoint_interval"] = s.checkpoint_interval
        data["pipeline_parallel"] = block
    data["batch"] = {"global": s.global_batch, "micro": s.micro_batch}
    data["precision"] = s.precision
    data["optimizer"] = {"name": "adamw", "lr": 0.0003, "weight_decay": 0.1, "betas": [0.9, 0.95]}
    data["gradient_clipping"] = 1.0
    data["model"] = spec.to_model_block()
    data["cluster"] = {"nodes": nodes, "gpus_per_node": min(result.gpus, result.gpus_per_node),
                       "gpu_memory_gb": round(result.gpu_memory / 1e9, 3)}
    data["launcher"] = "auto"
    return data
