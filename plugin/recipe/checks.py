"""Cross-field rules the schema cannot say, all reported at once, each with its JSON path and a fix.

Every rule an engine would assert minutes into a launch (world size, batch triple, ZeRO-2/3 with
pipelines, divisibility by the tensor degree...) is a recipe-time error here. Each ``check_*`` function is
one rule family: it receives the recipe and its resolved :class:`~plugin.recipe.layout.Layout` (``None`` when
the sizes could not be resolved) and yields :class:`~plugin.errors.Problem` s. Pure: no torch.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

from ..errors import WARNING, Problem, RecipeError
from .deepspeed_block import check_deepspeed_block
from .layout import Layout, batch_problems_for_any_data, known_grad_accum, resolve_layout
from .load import read_recipe_problems
from .spec import Recipe

Problems = Iterator[Problem]


def check_zero(recipe: Recipe, layout: Layout | None) -> Problems:
    z, pp = recipe.zero, recipe.parallelism.pipeline
    if z.stage >= 2 and pp > 1:
        yield Problem("$.zero.stage", f"ZeRO stage {z.stage} with pipeline {pp}: DeepSpeed refuses ZeRO-2/3 "
                      "together with pipeline parallelism (gradients are accumulated across micro-batches)",
                      'use "stage": 1 (or 0), or "pipeline": 1')
    if z.offload_param != "none" and z.stage != 3:
        yield Problem("$.zero.offload_param", f'offload_param "{z.offload_param}" needs ZeRO stage 3, '
                      f"the recipe has stage {z.stage}", 'set "stage": 3, or "offload_param": "none"')
    if z.offload_optimizer != "none" and z.stage < 1:
        yield Problem("$.zero.offload_optimizer", f'offload_optimizer "{z.offload_optimizer}" needs ZeRO '
                      "stage >= 1, the recipe has stage 0", 'set "stage": 1 or higher, or "offload_optimizer": "none"')
    if "nvme" in (z.offload_param, z.offload_optimizer) and not z.nvme_path:
        yield Problem("$.zero.nvme_path", "nvme offload needs nvme_path", 'add "nvme_path": "/local_nvme" '
                      "(a directory on a local NVMe drive)")


def check_batch_and_world(recipe: Recipe, layout: Layout | None) -> Problems:
    """The pipeline's micro-batch rules. Problems from resolving the sizes are :func:`check_recipe`'s.

    They need the micro-batches per step, not the data size: without a layout (``"auto"`` before the world
    size is known, a world that does not fit, a bad triple) they run whenever the batch block fixes that count.
    """
    pp = recipe.parallelism.pipeline
    m = layout.micro_batches if layout is not None else known_grad_accum(recipe.batch, recipe.parallelism.data)
    if pp == 1 or m is None:
        return
    if m < pp:
        at = (f" (global {layout.micro_batch * pp * layout.data} at micro {layout.micro_batch})"
              if layout is not None else "")
        yield Problem("$.batch", f"{m} micro-batch{'es' if m != 1 else ''} per step for {pp} pipeline stages: "
                      "some stages would idle the whole step",
                      f'give at least {pp} micro-batches: "grad_accum": {pp}{at}')
        return
    if recipe.pipeline_parallel.schedule == "interleaved_1f1b":
        rounds = max(1, m // pp)
        if m % rounds:
            good = sorted({pp * (m // pp), pp * (m // pp + 1)})
            yield Problem("$.batch.grad_accum", f"interleaved 1F1B (torch.distributed.pipelining) runs micro-batches "
                          f"in rounds of pipeline {pp}: {m} micro-batches make {rounds} rounds of unequal size",
                          f"use a multiple of {pp} micro-batches per step ({' or '.join(map(str, good))})")
    v = recipe.pipeline_parallel.virtual_stages
    bubble = (pp - 1) / (v * m)
    if bubble > 0.25:
        m_needed = math.ceil(4 * (pp - 1) / v)
        yield Problem("$.batch.grad_accum", f"pipeline bubble (p-1)/(v*m) = ({pp}-1)/({v}*{m}) = {bubble:.2f}: "
                      f"stages idle {bubble:.0%} of the step",
                      f"use >= {m_needed} micro-batches per step (bubble <= 0.25)", WARNING)


# the styles that hold key/value heads fewer than the tensor ranks (plugin/tensor_parallel/styles.py's column_heads)
PER_HEAD_STYLES = ("column_heads", "unit_colwise")


def _per_head_plan(recipe: Recipe) -> bool:
    """An explicit plan naming a per-head style ("auto" resolves against the model, which validate does not see)."""
    plan = recipe.tensor_parallel.plan
    return not isinstance(plan, str) and any(style in PER_HEAD_STYLES for style in plan.values())


def check_model_dims(recipe: Recipe, layout: Layout | None) -> Problems:
    m, tp, pp = recipe.model, recipe.parallelism.tensor, recipe.parallelism.pipeline
    if m is None:
        return
    if m.hidden % m.heads:
        yield Problem("$.model.hidden", f"hidden {m.hidden} is not divisible by heads {m.heads}",
                      f"use a hidden size that is a multiple of {m.heads}")
    kv = m.kv_heads_resolved
    if kv > m.heads or m.heads % kv:
        yield Problem("$.model.kv_heads", f"kv_heads {kv} must divide heads {m.heads}",
                      f"use one of {[d for d in range(1, m.heads + 1) if m.heads % d == 0]}")
    for key, value in (("heads", m.heads), ("kv_heads", kv), ("hidden", m.hidden),
                       ("ffn_hidden", m.ffn_hidden_resolved)):
        if key == "kv_heads" and m.kv_heads is None:  # not written: it is heads, whose error says it all
            continue
        replicable = key == "kv_heads" and tp % value == 0 and m.heads % tp == 0  # each head on tp / kv ranks
        if replicable and _per_head_plan(recipe):
            continue  # the plan holds each key/value head whole on the ranks that read it; initialize checks it
        if value % tp:
            per_head = (", or an explicit tensor_parallel.plan giving the key/value projections 'unit_colwise' "
                        "('column_heads': each head held by the ranks that read it)") if replicable else ""
            yield Problem(f"$.model.{key}", f"{key} {value} is not divisible by tensor {tp}: each tensor rank "
                          f"must hold whole {'heads' if 'heads' in key else 'columns'}",
                          f'use a tensor size that divides {value} ({_divisors(value, 8)}), or change {key}{per_head}')
    if tp > 1 and m.vocab % tp:
        padded = -(-m.vocab // tp) * tp
        yield Problem("$.model.vocab", f"vocab {m.vocab} is not divisible by tensor {tp}: the vocab-parallel "
                      f"embedding pads it to {padded} ({padded - m.vocab} unused rows)",
                      f"use a vocab of {padded} to make the padding explicit", WARNING)
    if pp > m.layers:
        yield Problem("$.parallelism.pipeline", f"pipeline {pp} > layers {m.layers}: some stages would hold no "
                      "transformer block", f"use pipeline <= {m.layers}")
    elif pp > 1 and recipe.pipeline_parallel.partition == "uniform" and m.layers % pp:
        yield Problem("$.pipeline_parallel.partition", f'"uniform" partition of {m.layers} layers over {pp} '
                      f"stages is uneven ({m.layers} % {pp} = {m.layers % pp})",
                      f'use a pipeline size that divides {m.layers} ({_divisors(m.layers, 16)}), or '
                      '"partition": "parameters"')
    sp = recipe.tensor_parallel.sequence_parallel
    if sp and m.seq_len % tp:
        yield Problem("$.model.seq_len", f"sequence_parallel splits the sequence over tensor {tp}, but seq_len "
                      f"{m.seq_len} is not divisible by {tp}", f"use a seq_len that is a multiple of {tp}")
    v = recipe.pipeline_parallel.virtual_stages
    if recipe.pipeline_parallel.schedule == "interleaved_1f1b" and v >= 2 and m.layers % (pp * v):
        yield Problem("$.pipeline_parallel.virtual_stages", f"interleaved 1F1B cuts {m.layers} layers into "
                      f"pipeline {pp} x virtual_stages {v} = {pp * v} chunks, which does not divide them",
                      f"use virtual_stages with {m.layers} % ({pp} x virtual_stages) == 0 "
                      f"({[d // pp for d in range(pp, m.layers + 1, pp) if m.layers % d == 0 and d // pp >= 2]})")


def check_tensor_parallel(recipe: Recipe, layout: Layout | None) -> Problems:
    tp = recipe.parallelism.tensor
    if recipe.tensor_parallel.sequence_parallel and tp == 1:
        yield Problem("$.tensor_parallel.sequence_parallel", "sequence_parallel needs tensor > 1 (it splits the "
                      "sequence over the tensor group)", 'set "tensor": 2 or more, or "sequence_parallel": false')
    if tp == 1 and recipe.tensor_parallel.plan != "auto":
        yield Problem("$.tensor_parallel.plan", "a tensor-parallel plan with tensor 1 is ignored",
                      'set "tensor" > 1, or drop the plan', WARNING)


def check_context_parallel(recipe: Recipe, layout: Layout | None) -> Problems:
    """The sequence split: 2 x context chunks of equal length (chunk i and 2C-1-i on context rank i, the causal work
    balanced), each also cut by tensor under sequence parallelism; Ulysses's head split needs whole heads per rank."""
    m, par, method = recipe.model, recipe.parallelism, recipe.context_parallel.method
    c, tp = par.context, par.tensor
    if c == 1:
        if method != "ring":
            yield Problem("$.context_parallel.method", f'"{method}" with context 1 is ignored: nothing is split',
                          'set "context" > 1 in $.parallelism, or drop the context_parallel block', WARNING)
        return
    if m is None:
        return
    sp = recipe.tensor_parallel.sequence_parallel and tp > 1
    step = 2 * c * (tp if sp else 1)
    if m.seq_len % step:
        why = (f"2 x context {c} chunks (context rank i holds chunks i and {2 * c - 1}-i), each cut over tensor {tp} "
               "by sequence parallelism" if sp else f"2 x context {c} equal chunks (context rank i holds chunks i and "
               f"{2 * c - 1}-i, so the causal work is balanced)")
        good = [n for n in (m.seq_len - m.seq_len % step, m.seq_len - m.seq_len % step + step) if n > 0]
        yield Problem("$.model.seq_len", f"seq_len {m.seq_len} is not divisible by {step}: the sequence is cut into "
                      f"{why}", f"use a seq_len that is a multiple of {step} ({' or '.join(map(str, good))})")
    if method == "all_to_all":
        ranks = tp * c
        kv = [("kv_heads", m.kv_heads)] if m.kv_heads not in (None, m.heads) else []  # else heads says it
        for key, value in [("heads", m.heads), *kv]:
            if value % ranks:
                yield Problem(f"$.model.{key}", f"{key} {value} is not divisible by tensor {tp} x context {c} = "
                              f'{ranks}: "all_to_all" gives each context rank whole heads of its tensor rank\'s share',
                              f'use "method": "ring" (any head count), or {key} a multiple of {ranks}, or a context '
                              f"size with tensor x context dividing {value}")


def check_expert(recipe: Recipe, layout: Layout | None) -> Problems:
    """The expert axis, before any group: E divides data x context (the experts' ranks are carved out of them), the
    experts divide over E, the expert tensor degree is the tensor degree or 1, and the model has experts at all."""
    par, m = recipe.parallelism, recipe.model
    e, etp = par.expert, par.expert_tensor
    moe = m.moe if m is not None else None
    if moe is not None:
        if moe.top_k > moe.experts:
            yield Problem("$.model.moe.top_k", f"top_k {moe.top_k} > experts {moe.experts}: a token cannot reach "
                          "more experts than there are", f"use top_k <= {moe.experts}")
        if moe.every > m.layers:
            yield Problem("$.model.moe.every", f"every {moe.every} > layers {m.layers}: no block would be a MoE block",
                          f"use every <= {m.layers} (1: every block)")
        ffn = moe.ffn_hidden if moe.ffn_hidden is not None else m.ffn_hidden_resolved
        split = par.expert_tensor_resolved
        if ffn % split:
            yield Problem("$.model.moe.ffn_hidden", f"expert ffn_hidden {ffn} is not divisible by expert tensor "
                          f"{split}: each tensor rank holds whole columns of every expert it holds",
                          f"use an expert ffn_hidden that is a multiple of {split}, or \"expert_tensor\": 1")
    if etp is not None and etp not in (1, par.tensor):
        yield Problem("$.parallelism.expert_tensor", f"expert_tensor {etp}: experts are split over the tensor group "
                      f"(tensor {par.tensor}) or kept whole", f'use "expert_tensor": 1 or {par.tensor}, or drop it')
    if e == 1:
        return
    if m is not None and moe is None:  # a warning: a transformers MoE family sized by this block has experts
        yield Problem("$.parallelism.expert", f"expert {e} places the experts of mixture-of-experts layers over {e} "
                      "ranks, but the recipe's model has none: the reference GPT it describes has no experts (a "
                      "transformers MoE family sized by it, train.py --model mixtral, has them; checked when the "
                      "model is built)", 'add "moe": {"experts": N} to $.model for the reference GPT, or set '
                      '"expert": 1', severity=WARNING)
    if moe is not None and moe.experts % e:
        yield Problem("$.parallelism.expert", f"experts {moe.experts} are not divisible by expert {e}: every expert "
                      "rank holds the same number of whole experts",
                      f"use an expert degree that divides {moe.experts} ({_divisors(moe.experts, 64)})")
    dc = (layout.data if layout is not None else par.data if isinstance(par.data, int) else None)
    if dc is not None:
        dc *= par.context
        if dc % e:
            words = f"data {dc // par.context} x context {par.context} = {dc}" if par.context > 1 else f"data {dc}"
            good = [d for d in range(1, dc + 1) if dc % d == 0]
            yield Problem("$.parallelism.expert", f"expert {e} does not divide {words}: the experts' ranks are carved "
                          "out of data x context (Megatron's and torchtitan's rule; the world is unchanged)",
                          f"use an expert degree in {good}, or a data size that is a multiple of {e}")


def check_pipeline(recipe: Recipe, layout: Layout | None) -> Problems:
    pp_cfg, pp = recipe.pipeline_parallel, recipe.parallelism.pipeline
    if pp_cfg.schedule == "interleaved_1f1b":
        if pp_cfg.virtual_stages < 2:
            yield Problem("$.pipeline_parallel.virtual_stages", f"interleaved_1f1b needs virtual_stages >= 2, "
                          f"got {pp_cfg.virtual_stages}", 'set "virtual_stages": 2 (model chunks per rank)')
        if pp == 1:
            yield Problem("$.pipeline_parallel.schedule", "interleaved_1f1b with pipeline 1 has nothing to "
                          "interleave", 'set "pipeline" > 1, or "schedule": "1f1b"')
    elif pp_cfg.virtual_stages > 1:
        yield Problem("$.pipeline_parallel.virtual_stages", f"virtual_stages {pp_cfg.virtual_stages} only means "
                      f'something with "schedule": "interleaved_1f1b", the recipe has "{pp_cfg.schedule}"',
                      'set "schedule": "interleaved_1f1b", or "virtual_stages": 1')
    if pp > 1 and recipe.launcher == "deepspeed" and pp_cfg.schedule != "1f1b":
        yield Problem("$.pipeline_parallel.schedule", f'DeepSpeed\'s PipelineEngine runs 1F1B only, the recipe '
                      f'asks for "{pp_cfg.schedule}" with "launcher": "deepspeed"',
                      'use "schedule": "1f1b", or "launcher": "auto"/"torchrun"/"accelerate" (native back end, '
                      "torch.distributed.pipelining)")
    if pp > 1 and pp_cfg.partition.startswith("type:"):
        import re

        try:
            re.compile(pp_cfg.partition[5:])
        except re.error as e:
            yield Problem("$.pipeline_parallel.partition", f"invalid regular expression after type: ({e})",
                          'write "type:" followed by a Python regex matching layer class names, e.g. "type:Block"')


def check_activation_checkpointing(recipe: Recipe, layout: Layout | None) -> Problems:
    ac, m = recipe.activation_checkpointing, recipe.model
    if ac.mode != "full" and ac.every != 1:
        yield Problem("$.activation_checkpointing.every", f'every {ac.every} is only read under "mode": "full", '
                      f'the recipe has "{ac.mode}"', f'set "mode": "full" (spans of {ac.every} blocks), or drop '
                      '"every"', WARNING)
    if ac.mode == "full" and m is not None and ac.every > m.layers:
        yield Problem("$.activation_checkpointing.every", f"every {ac.every} > layers {m.layers}: one span holds "
                      "every block, so backward recomputes the whole model at once",
                      f'use "every" <= {m.layers} (1 keeps the least)', WARNING)


def check_native_back_end(recipe: Recipe, layout: Layout | None = None, *, chosen: bool = False) -> Problems:
    """What the native back end (DDP / ZeroRedundancyOptimizer / FSDP2) cannot do: DeepSpeed's nvme offload, and
    offload below ZeRO-2. As a recipe rule only where the recipe names that back end (``"launcher"``
    ``"accelerate"`` or ``"torchrun"``); with ``chosen``, whenever it trains: :func:`plugin.engines.initialize.
    initialize` passes it when the native back end was chosen because deepspeed is missing."""
    if not chosen and recipe.launcher not in ("accelerate", "torchrun"):
        return
    z = recipe.zero
    if "nvme" in (z.offload_param, z.offload_optimizer):
        yield Problem("$.zero", "nvme offload is DeepSpeed's (ZeRO-Infinity); the native back end (chosen by "
                      f'"launcher": "{recipe.launcher}", or because deepspeed is missing) offloads to CPU only',
                      'use "cpu" offload, or "launcher": "deepspeed" with deepspeed installed')
    elif z.offload_optimizer != "none" and z.stage < 2:
        yield Problem("$.zero.offload_optimizer", f"the native back end offloads through FSDP2 (ZeRO stage 2/3); "
                      f"stage {z.stage} runs DDP/ZeroRedundancyOptimizer, which cannot offload",
                      'set "stage": 2 or 3, or "launcher": "deepspeed" with deepspeed installed')


def check_deepspeed_back_end(recipe: Recipe, layout: Layout | None = None, *, chosen: bool = False) -> Problems:
    """bf16 at ZeRO-0 on DeepSpeed without a pipeline, where gradients are summed (``data`` x ``context`` x
    ``grad_accum`` > 1): DeepSpeed 0.19.8 then accumulates the micro-batches' gradients in bf16 (FP16_Optimizer; fp32
    accumulation, ``data_types.grad_accum_dtype``, it refuses at stage 0 as an "unsupported mix") and keeps the
    data-parallel sum in bf16 (all-reduced in fp32, rounded back), where ZeRO-1, its pipeline engine and the native
    back end keep both in fp32. As a recipe rule only where the recipe names that back end (``"launcher":
    "deepspeed"``) and the layout is known; with ``chosen``, whenever it trains:
    :func:`plugin.engines.initialize.initialize` passes it when the DeepSpeed back end was chosen."""
    if (not chosen and recipe.launcher != "deepspeed") or layout is None:
        return
    if recipe.precision == "bf16" and recipe.zero.stage == 0 and recipe.parallelism.pipeline == 1 \
            and layout.data * layout.context * layout.grad_accum > 1:
        over = f"{layout.data} data" + (f" x {layout.context} context" if layout.context > 1 else "")
        yield Problem("$.zero.stage", f"bf16 at ZeRO stage 0 on DeepSpeed accumulates the gradients of "
                      f"{layout.grad_accum} micro-batch(es) in bf16 and keeps their sum over {over} "
                      "rank(s) in bf16 (DeepSpeed refuses fp32 accumulation at stage 0), where every other layout "
                      "keeps them in fp32",
                      'use "zero": {"stage": 1} (fp32 sums, less optimizer memory), or the native back end '
                      '("launcher": "torchrun")')


def check_precision_and_optimizer(recipe: Recipe, layout: Layout | None) -> Problems:
    if recipe.fp16 is not None and recipe.precision != "fp16":
        yield Problem("$.fp16", f'a loss-scale block with precision "{recipe.precision}" is ignored',
                      'set "precision": "fp16", or drop the fp16 block', WARNING)
    opt = recipe.optimizer
    if opt.name == "sgd" and (opt.betas != (0.9, 0.999) or opt.eps != 1e-08):
        yield Problem("$.optimizer", "betas and eps are Adam's; sgd ignores them", "drop them", WARNING)
    if opt.name != "sgd" and opt.momentum:
        yield Problem("$.optimizer.momentum", f"momentum is SGD's; {opt.name} ignores it",
                      "drop it, or use betas[0] for Adam's momentum", WARNING)


def check_lr_schedule(recipe: Recipe, layout: Layout | None) -> Problems:
    """The schedule's steps in order, its floor under the peak, and one scheduler only (the plugin's or DeepSpeed's)."""
    s, lr = recipe.lr_schedule, recipe.optimizer.lr
    if s is None:
        return
    if s.decay != "constant" and s.decay_steps is None:
        yield Problem("$.lr_schedule.decay_steps", f'"decay": "{s.decay}" needs the step where it reaches min_lr',
                      f'add "decay_steps": the step the {s.decay} decay ends at (e.g. your run\'s --steps)')
    elif s.decay_steps is not None and s.decay_steps < s.warmup_steps:
        yield Problem("$.lr_schedule.decay_steps", f"decay_steps {s.decay_steps} < warmup_steps {s.warmup_steps}: "
                      "the decay would end before the warmup does",
                      f'use "decay_steps" >= {s.warmup_steps}, or fewer "warmup_steps"')
    if s.min_lr > lr:
        yield Problem("$.lr_schedule.min_lr", f"min_lr {s.min_lr:g} > the optimizer's lr {lr:g}: the decay would "
                      "raise the learning rate", f'use "min_lr" <= {lr:g} (e.g. {lr / 10:g}), or a larger lr')
    if s.decay == "constant" and (s.decay_steps is not None or s.min_lr):
        yield Problem("$.lr_schedule.decay", '"decay": "constant" keeps the optimizer\'s lr after the warmup: '
                      "decay_steps and min_lr are ignored", 'set "decay": "linear" or "cosine", or drop them', WARNING)
    if recipe.deepspeed is not None and "scheduler" in recipe.deepspeed:
        yield Problem("$.deepspeed.scheduler", "the recipe has an lr_schedule, which the plugin applies on every back "
                      "end; a raw DeepSpeed scheduler would set the learning rate a second time",
                      "drop $.deepspeed.scheduler (or $.lr_schedule to keep DeepSpeed's, on the DeepSpeed back end "
                      "only)")


def check_watchdog(recipe: Recipe, layout: Layout | None) -> Problems:
    """The hang guard's timeout: at least 5 s (the schema says so for JSON; a recipe built in Python is held here)."""
    t = recipe.watchdog.timeout_s
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 5:
        yield Problem("$.watchdog.timeout_s", f"timeout_s {t!r}: the hang guard needs at least 5 s (its heartbeat "
                      "beats every second or more, and a peer must be silent that long to be taken for stopped)",
                      'use "timeout_s": 600 (the default), or at least 5')


def check_cluster(recipe: Recipe, layout: Layout | None) -> Problems:
    c = recipe.cluster
    if c is None:
        return
    tp = recipe.parallelism.tensor
    if tp > c.gpus_per_node:
        yield Problem("$.parallelism.tensor", f"tensor {tp} > gpus_per_node {c.gpus_per_node}: every tensor "
                      "group would cross nodes (2 all-reduces per block over the inter-node network)",
                      f"keep tensor <= {c.gpus_per_node}; use pipeline or data parallelism across nodes", WARNING)
    elif c.gpus_per_node % tp:
        yield Problem("$.parallelism.tensor", f"tensor {tp} does not divide gpus_per_node {c.gpus_per_node}: "
                      "some tensor groups would straddle two nodes",
                      f"use a tensor size that divides {c.gpus_per_node}", WARNING)
    if layout is None:
        return
    capacity = c.nodes * c.gpus_per_node
    if layout.world_size > capacity:
        yield Problem("$.cluster", f"the recipe needs {layout.world_size} processes, the cluster has "
                      f"{c.nodes} x {c.gpus_per_node} = {capacity}",
                      f"use nodes >= {-(-layout.world_size // c.gpus_per_node)}, or a smaller layout")
    elif layout.world_size < capacity:
        fill = (f"launch {capacity} processes to fill them" if recipe.parallelism.data == "auto"
                else 'use "data": "auto" to fill them')
        yield Problem("$.cluster", f"the recipe uses {layout.world_size} of the cluster's {capacity} GPUs",
                      f"{fill}, or describe the cluster you run on", WARNING)


def check_name(recipe: Recipe, layout: Layout | None) -> Problems:
    stem = recipe.file_stem
    if stem and stem != recipe.name:
        yield Problem("$.name", f'name "{recipe.name}" differs from the file name "{Path(recipe.source).name}"',
                      f'rename the file to {recipe.name}.json, or set "name": "{stem}"', WARNING)


RULES = (check_zero, check_batch_and_world, check_model_dims, check_tensor_parallel, check_context_parallel,
         check_expert, check_pipeline, check_activation_checkpointing, check_native_back_end, check_deepspeed_back_end,
         check_precision_and_optimizer, check_lr_schedule, check_watchdog, check_cluster, check_name,
         check_deepspeed_block)


def check_recipe(recipe: Recipe, world_size: int | None = None) -> list[Problem]:
    """Every cross-field problem of ``recipe`` at ``world_size`` (the launcher's process count, if known).

    Every rule runs, with or without a resolved layout: a rule that needs the data size skips only the
    part that needs it, so one pass reports everything that is already certain.
    """
    if recipe.parallelism.data == "auto" and world_size is None:
        # "auto" is fine until a world size is known; what no data size can fix is wrong already
        layout, problems = None, batch_problems_for_any_data(recipe.batch)
    else:
        layout, problems = resolve_layout(recipe, world_size)
    for rule in RULES:
        problems.extend(rule(recipe, layout))
    return [p.with_file(recipe.source) for p in problems]


def validate(ref: str | Path, world_size: int | None = None) -> tuple[Recipe | None, list[Problem]]:
    """Read, schema-check and cross-check a recipe: ``(recipe or None, every problem)``.

    The recipe is ``None`` when any error was found; warnings come with a recipe.
    """
    recipe, problems = read_recipe_problems(ref)
    if recipe is None:
        return None, problems
    problems = problems + check_recipe(recipe, world_size)
    return (None if any(p.is_error for p in problems) else recipe), problems


def load_recipe(ref: str | Path, world_size: int | None = None) -> Recipe:
    """A valid recipe, or :class:`RecipeError` listing every error (warnings are dropped; see :func:`validate`)."""
    recipe, problems = validate(ref, world_size)
    if recipe is None:
        raise RecipeError(problems)
    return recipe


def _divisors(n: int, limit: int) -> str:
    return ", ".join(str(d) for d in range(1, min(n, limit) + 1) if n % d == 0)
