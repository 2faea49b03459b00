"""Find the fastest layout that fits: enumerate, estimate, rank, explain (pure).

Every layout of ``gpus`` = tensor x context x pipeline x data is tried, a context degree C > 1 with each
attention method it allows (``ring``; ``all_to_all`` too where tensor x context divides heads and kv_heads),
with each ZeRO stage (2 and 3 only without pipeline parallelism, as DeepSpeed requires; above 0 only with
more than one replica, data x context, to shard over), sequence parallelism on and off (tensor > 1), each
recompute mode and every micro-batch size that divides the per-replica batch; each layout is ranked at
its fastest micro-batch (so the top K are K different layouts, not one layout's micro-batch sizes).
A layout is valid when the recipe checks would pass it (:mod:`plugin.planning.layouts` holds their rules): the
tensor size divides heads, kv_heads, hidden and ffn_hidden, the pipeline has no more stages than layers, the data
size divides the global batch, and seq_len cuts into 2 x C chunks (each cut over tensor again under sequence
parallelism). Those whose most loaded rank fits in the usable memory
(:func:`plugin.planning.memory.usable_memory`) are ranked by :func:`plugin.planning.steptime.step_time`
(DeepSpeed's overlap behaviour, see there), ties by memory.

Tensor groups stay inside a node, and so do context groups: layouts whose context groups would cross nodes are
tried only when no other fits, then those whose tensor groups would (a context group sends keys and values once
per block, the ring's under the attention's compute; a tensor group all-reduces the activations four times), and
the result says so. Memory grows with the micro-batch size, so the search stops at the first micro-batch that does
not fit. A context layout's micro-batch that is a multiple of C is skipped where its twin, the same layout with
data x C instead of the axis, is searched (the global batch divides over it) and counts the attention's core alike
(a fused kernel, or all-to-all): at micro-batch mb / C the twin holds the same tokens per rank and micro-batches per
step, model states and traffic, less the context attention's outputs and traffic, so it needs no more memory and
no more time; what the context axis adds that data parallelism cannot is fewer tokens per rank than one
sequence, so micro-batches that are not multiples of C are all searched. With both rules the context axis about
doubles the layouts estimated (llama2-7b on 512 GPUs: 2,270 against 1,112) and takes two to three times as long:
512 GPUs still take well under a second (``python bench/planner.py``). A cluster is whole nodes alike (a recipe's
``cluster`` is nodes x gpus_per_node): more GPUs than one node holds must be a multiple of it.

The recompute modes are the recipe's ``activation_checkpointing`` modes: ``none``, ``selective`` (the attention
core) and ``full`` (``"every": 1``). Attention is taken as fused (FlashAttention) unless ``fused_attention=False``
(eager attention, or SDPA's math kernel, which stores the softmax): a fused kernel never stores the core, so
``selective`` keeps what ``none`` keeps at the same time and is skipped there as a duplicate, except on a
context axis, where it checkpoints the context attention (dropping the outputs it keeps, running its forward
again); with unfused attention it is ranked like any other mode. A SwiGLU MLP is taken as a fused kernel (6sbf),
dropout masks as counted when the model's dropout is above 0.

``as_recipe=True`` ranks the model a recipe of the model's dimensions describes (the reference GPT,
:meth:`plugin.planning.dims.ModelSpec.as_recipe_model`) instead of the model itself: what ``--write`` writes, and
what ``estimate`` of the written recipe counts. :mod:`plugin.planning.to_recipe` writes and checks it.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from .dims import ModelSpec, params_text
from .layouts import (
    context_methods,
    context_sizes,
    divisors,
    expert_sizes,
    pipeline_sizes,
    sequence_parallel_choices,
    tensor_sizes,
    zero_stages,
)
from .memory import memory_per_rank, usable_memory
from .reasons import explain
from .setup import Breakdown, Setup
from .steptime import HARDWARE, Hardware, StepTime, group_inside_node, step_time
from .units import fmt_gb

DEFAULT_TOKENS_PER_BATCH = 2**22  # about 4M tokens, the batch Llama 2 trained with
RECIPE_RECOMPUTE = ("none", "selective", "full")  # activation_checkpointing.mode; the last saves the most


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
    closest: Plan | None = None  # the least-memory layout, when nothing fits
    advice: str = ""
    requested: ModelSpec | None = None  # the model asked for, when ``spec`` is its recipe model instead
    assumptions: tuple[str, ...] = ()

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
            "requested_model": self.requested.to_json() if self.requested else None,
            "notes": list(self.notes), "assumptions": list(self.assumptions), "advice": self.advice,
            "plans": [p.to_json() for p in self.plans],
            "closest": self.closest.to_json() if self.closest else None,
        }


def default_global_batch(gpus: int, seq_len: int) -> int:
    """About 4M tokens, rounded to a multiple of ``gpus`` (so every data size divides it)."""
    target = max(1, DEFAULT_TOKENS_PER_BATCH // seq_len)
    return gpus * max(1, round(target / gpus))


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
    fused_attention: bool = True
    considered: int = 0
    fits: list = field(default_factory=list)  # (time, memory, counter, Setup, Breakdown, StepTime)
    smallest: tuple | None = None  # (memory, Setup, Breakdown) of the least-memory layout tried

    def run(self, cross_node: bool, context_across: bool = False) -> None:
        """Search the layouts whose tensor groups cross nodes (``cross_node``), else those with tensor groups inside
        a node and context groups inside one too, or crossing nodes (``context_across``)."""
        for tp in tensor_sizes(self.spec, self.gpus):
            for cp in context_sizes(self.spec, self.gpus // tp):
                for pp in pipeline_sizes(self.spec, self.gpus // (tp * cp)):
                    dp = self.gpus // (tp * cp * pp)
                    if self.global_batch % dp:
                        continue
                    placed = Setup(tp=tp, pp=pp, dp=dp, cp=cp)
                    if group_inside_node("tensor", placed, self.gpus_per_node) == cross_node:
                        continue
                    if not cross_node and group_inside_node("context", placed, self.gpus_per_node) == context_across:
                        continue
                    for method in context_methods(self.spec, tp, cp):
                        self._layouts(tp, pp, dp, cp, method)

    def _layouts(self, tp: int, pp: int, dp: int, cp: int, method: str) -> None:
        per_replica = self.global_batch // dp
        # The context layout's twin, data dp x cp without the axis, at micro-batch mb / cp holds the same tokens per
        # rank and runs as many micro-batches, with the same model states and traffic less the context attention's:
        # no more memory, no more time (module docstring). Those micro-batches are searched there, not here.
        twin = cp > 1 and self.global_batch % (dp * cp) == 0 and (self.fused_attention or method == "all_to_all")
        micro_sizes = [mb for mb in divisors(per_replica) if not (twin and mb % cp == 0)]
        for zero, ep in itertools.product(zero_stages(dp * cp, pp), expert_sizes(self.spec, dp * cp)):
            for sp in sequence_parallel_choices(self.spec, tp, cp):
                for mode in self.recompute_modes:
                    if mode == "selective" and self.fused_attention and cp == 1:
                        continue  # the fused kernel stores no core: the same memory and time as "none"
                    best = None  # this layout at its fastest micro-batch
                    for mb in micro_sizes:
                        setup = Setup(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, cp_method=method, zero_stage=zero,
                                      micro_batch=mb,
                                      micro_batches=per_replica // mb, recompute=mode, sequence_parallel=sp,
                                      precision=self.precision, dropout=self.spec.dropout > 0,
                                      fused_attention=self.fused_attention)
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
         global_batch: int | None = None, top: int = 5, hardware: Hardware = HARDWARE["h100"],
         precision: str = "bf16", recompute_modes: Sequence[str] = RECIPE_RECOMPUTE,
         as_recipe: bool = False, fused_attention: bool = True) -> PlanResult:
    """Rank every valid layout of ``spec`` on ``gpus`` accelerators of ``gpu_memory`` bytes each.

    ``as_recipe``: rank the model a recipe of ``spec``'s dimensions describes (module docstring).
    ``fused_attention``: attention on a fused kernel (no stored softmax; the default), else eager. Raises
    ValueError for sizes below 1 and for more GPUs than a node holds that do not fill whole nodes.
    """
    if gpus < 1 or gpus_per_node < 1 or top < 1:
        raise ValueError(f"gpus, gpus_per_node and top must be >= 1, got {gpus}, {gpus_per_node}, {top}")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise ValueError(whole_nodes_message(gpus, gpus_per_node))
    requested = None
    notes: list[str] = []
    if as_recipe and not spec.is_recipe_model():
        requested, spec = spec, spec.as_recipe_model()
        notes.append(f"ranked as the model the written recipe describes: the reference GPT with "
                     f"{requested.name}'s dimensions, so " + ", ".join(spec.architecture_differences(requested))
                     + f" ({params_text(spec.total_params())} parameters, not {params_text(requested.total_params())});"
                     f" a recipe's model block cannot state {requested.name}'s own architecture")
    elif not spec.is_recipe_model():
        notes.append(f"ranked as {spec.name} itself; a recipe's model block describes the reference GPT ("
                     + ", ".join(spec.as_recipe_model().architecture_differences(spec))
                     + "), so --write ranks that model instead")
    batch = global_batch if global_batch is not None else default_global_batch(gpus, spec.seq_len)
    usable, reserve = usable_memory(gpu_memory)
    search = _Search(spec, gpus, gpus_per_node, usable, batch, hardware, precision, tuple(recompute_modes),
                     fused_attention=fused_attention)
    search.run(cross_node=False)
    if not search.fits:
        # context groups across nodes before tensor groups: they send keys and values once per block (the ring's
        # hidden under the attention's compute), tensor groups all-reduce the activations four times
        search.run(cross_node=False, context_across=True)
        if search.fits:
            notes.append(f"no layout with tensor and context groups inside a node ({gpus_per_node} GPUs) fits; "
                         f"these split context groups across nodes, whose keys and values go over InfiniBand")
    if not search.fits:
        search.run(cross_node=True)
        if search.fits:
            notes.append(f"no layout with tensor groups inside a node ({gpus_per_node} GPUs) fits; these "
                         f"split tensor groups across nodes, whose all-reduces go over InfiniBand")
    best = heapq.nsmallest(top, search.fits)
    plans = explain([Plan(setup=s, memory=m, time=t) for _, _, _, s, m, t in best], usable, spec,
                     gpus_per_node)
    result = PlanResult(spec=spec, gpus=gpus, gpus_per_node=gpus_per_node, gpu_memory=gpu_memory,
                        global_batch=batch, hardware=hardware, plans=tuple(plans), considered=search.considered,
                        fitting=len(search.fits), notes=tuple(notes), requested=requested,
                        assumptions=assumptions(spec, recompute_modes, fused_attention))
    if plans:
        return result
    return _nothing_fits(result, search, usable, reserve)


def whole_nodes_message(gpus: int, gpus_per_node: int) -> str:
    """Why ``gpus`` that do not fill whole nodes are refused, and what to use instead."""
    lo, hi = gpus // gpus_per_node * gpus_per_node, -(-gpus // gpus_per_node) * gpus_per_node
    fits = [d for d in divisors(gpus) if 1 < d < gpus_per_node][-2:]
    other = f", or --gpus-per-node {' or '.join(map(str, reversed(fits)))}" if fits else ""
    return (f"--gpus {gpus} does not fill whole nodes of --gpus-per-node {gpus_per_node}: a recipe's cluster is "
            f"nodes x gpus_per_node, every node alike, and launchers start the same number of processes on "
            f"each -> use --gpus {lo} or {hi}{other}")


def assumptions(spec: ModelSpec, recompute_modes: Sequence[str], fused_attention: bool = True) -> tuple[str, ...]:
    """What the ranking takes for granted, in words (printed by ``plan``)."""
    modes = ", ".join(recompute_modes)
    skipped = fused_attention and "selective" in recompute_modes
    out = [f"recompute searched: {modes}"
           + ("; selective ranks as none here (a fused attention kernel stores no softmax, so there is no core "
              "to recompute): listed only for unfused attention and context layouts (whose checkpointed context "
              "attention drops the outputs it keeps, at a forward of it more)" if skipped else ""),
           "data-parallel traffic timed as DeepSpeed runs it (overlap_comm off at ZeRO 0-2: gradient "
           "reductions exposed; on at ZeRO-3: gathers prefetched); torch DDP would hide more of ZeRO-0's",
           "context searched: C > 1 where seq_len cuts into 2C chunks (2CT with sequence parallelism), ring, and "
           "all-to-all where T x C divides heads and kv_heads; context groups inside a node unless nothing else "
           "fits. A context layout trains on the native back end (DeepSpeed has no context axis), its data-parallel "
           "traffic timed as DeepSpeed's all the same: an upper bound there (DDP and FSDP2 overlap more)",
           ("attention fused (FlashAttention / SDPA: no stored softmax); dropout " if fused_attention else
            "attention unfused (eager, or SDPA's math kernel: the softmax and its dropout stored); dropout ")
           + (f"{spec.dropout:g}: masks counted" if spec.dropout else "off (no masks)")]
    if spec.mlp == "swiglu":
        out.append("SwiGLU as a fused kernel (6sbf stored); eager PyTorch stores 8sbf")
    out.append("learning rate: a schedule changes neither step time nor memory (the plugin sets each step's lr on the "
               'host); --write writes AdamW at a constant lr 3e-4: add "lr_schedule" (warmup, linear or cosine decay) '
               "to the recipe")
    return tuple(out)


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
                               search.recompute_modes, search.fused_attention)
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
                   precision: str, modes: Sequence[str], search_fused: bool = True) -> int | None:
    """The smallest gpus x 2^k (k <= 10) where some layout fits, at micro-batch 1; None if none.

    Per tensor and pipeline size only the largest context size is tried (ring attention, any head count), and the
    largest that allows sequence parallelism: ZeRO shards over data x context, the same for every split of the
    rest into those two, and a larger context only leaves fewer tokens on each rank."""
    for k in range(1, 11):
        n = gpus * 2**k
        for tp in tensor_sizes(spec, n):
            for pp in divisors(n // tp):
                if pp > spec.layers:
                    continue
                rest = n // (tp * pp)  # data x context
                sizes = context_sizes(spec, rest)
                with_sp = [c for c in sizes if True in sequence_parallel_choices(spec, tp, c)]
                for cp, sp in {(sizes[-1], False), *([(with_sp[-1], True)] if with_sp else [])}:
                    zero = 3 if (pp == 1 and rest > 1) else (1 if rest > 1 else 0)
                    setup = Setup(tp=tp, pp=pp, dp=rest // cp, cp=cp, zero_stage=zero, micro_batch=1,
                                  micro_batches=max(pp, 1), recompute=modes[-1], sequence_parallel=sp,
                                  precision=precision, dropout=spec.dropout > 0, fused_attention=search_fused)
                    if memory_per_rank(spec, setup).total <= usable:
                        return n
    return None


def describe_result(result: PlanResult) -> str:
    """One line on what was searched: model, GPUs, batch, hardware assumptions."""
    spec = result.spec
    nodes = max(1, result.gpus // result.gpus_per_node)
    return (f"{spec.name} ({params_text(spec.total_params())} parameters, seq {spec.seq_len}) on {result.gpus} "
            f"GPUs ({nodes} node{'s' if nodes > 1 else ''} of {min(result.gpus, result.gpus_per_node)}), "
            f"{fmt_gb(result.gpu_memory, 0)} each ({fmt_gb(result.usable)} usable); global batch "
            f"{result.global_batch} sequences = {_tokens(result.global_batch * spec.seq_len)} tokens; "
            f"{result.hardware.describe()}")


def _tokens(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"

