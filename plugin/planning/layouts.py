"""Which degrees and settings the layout search tries: the recipe checks' rules, as quick predicates (pure).

Each rule is one of :mod:`plugin.recipe.checks`, asked of numbers instead of a recipe, so that the search
(:mod:`plugin.planning.search`) never ranks a layout whose written recipe ``validate`` refuses:

- tensor T divides heads, kv_heads, hidden and ffn_hidden (``check_model_dims``);
- sequence parallelism needs T > 1 and seq_len divisible by T (``check_model_dims``, ``check_tensor_parallel``);
- context C > 1 cuts every row into 2 x C equal chunks, each cut over T again under sequence parallelism: seq_len
  divisible by 2C, or by 2CT with sequence parallelism; ``"all_to_all"`` gives each of the T x C ranks whole heads:
  heads and kv_heads divisible by T x C (``check_context_parallel``). The written recipe says ``"launcher": "auto"``,
  which trains a context axis on the native back end (the rule's one refusal, ``"launcher": "deepspeed"``, is
  never written);
- ZeRO stages 2 and 3 not with pipeline parallelism (``check_zero``), and stages above 0 only where there is
  more than one replica (data x context) to shard over;
- no more pipeline stages than layers (``check_model_dims``; the written ``"partition": "parameters"`` takes any
  stage count up to that);
- a mixture of experts: the expert degree E divides data x context and the experts (``check_expert``), each
  expert's inner size divides over T (the experts split over the tensor group, ``check_expert``), and what the
  expert axis reaches (:func:`plugin.expert_parallel.checks.check_expert_reach`): no pipeline stages with the
  sigmoid router, any ZeRO stage the recipe checks allow.

``tests/unit/planning/test_layouts.py`` holds every predicate to the recipe check it mirrors.
"""
from __future__ import annotations

import math

from .dims import ModelSpec

CONTEXT_METHODS = ("ring", "all_to_all")  # the recipe's context_parallel.method values


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def tensor_sizes(spec: ModelSpec, gpus: int) -> list[int]:
    """Tensor sizes that divide the GPUs and the heads, kv_heads, hidden and ffn sizes."""
    return [t for t in divisors(gpus)
            if not (spec.heads % t or spec.kv % t or spec.hidden % t or spec.ffn % t
                    or (spec.moe_experts and spec.moe_ffn % t))]


def pipeline_sizes(spec: ModelSpec, gpus: int) -> list[int]:
    """Pipeline sizes that divide ``gpus``, no more than the layers; 1 alone for MoE layers with the sigmoid router
    (the schedule's shape-inferring forward would count its loads twice)."""
    if spec.moe_experts and dict(spec.moe_options).get("router") == "sigmoid":
        return [1]
    return [p for p in divisors(gpus) if p <= spec.layers]


def expert_sizes(spec: ModelSpec, replicas: int) -> list[int]:
    """Expert degrees: 1 for a dense model, else those dividing data x context (``replicas``) and the experts."""
    return [e for e in divisors(replicas) if spec.moe_experts % e == 0] if spec.moe_experts else [1]


def context_sizes(spec: ModelSpec, gpus: int) -> list[int]:
    """Context sizes that divide ``gpus`` and cut seq_len into 2 x C equal chunks (1 always: no split)."""
    return [c for c in divisors(gpus) if c == 1 or spec.seq_len % (2 * c) == 0]


def context_methods(spec: ModelSpec, tp: int, cp: int) -> tuple[str, ...]:
    """The attention methods a context degree can use: none to choose at C = 1 (written as no block); ``"ring"``
    for any head count; ``"all_to_all"`` only with heads and kv_heads divisible by T x C."""
    if cp == 1:
        return ("ring",)  # Setup's default, what a recipe without a context_parallel block reads back
    ranks = tp * cp
    whole_heads = spec.heads % ranks == 0 and spec.kv % ranks == 0
    return CONTEXT_METHODS if whole_heads else ("ring",)


def sequence_parallel_choices(spec: ModelSpec, tp: int, cp: int = 1) -> list[bool]:
    """[False], and True too where the sequence (each of the 2C chunks with a context axis) divides over T."""
    if tp == 1 or spec.seq_len % tp:
        return [False]
    if cp > 1 and spec.seq_len % (2 * cp * tp):
        return [False]
    return [False, True]


def zero_stages(replicas: int, pp: int) -> list[int]:
    """ZeRO stages worth trying: only 0 with one replica (nothing to shard), 0-1 with pipeline stages (DeepSpeed
    refuses 2 and 3 there, and the recipe with it), else 0-3."""
    if replicas == 1:
        return [0]
    return [0, 1] if pp > 1 else [0, 1, 2, 3]
