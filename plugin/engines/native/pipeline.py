"""Pipeline stages on ``torch.distributed.pipelining``, with the plugin's tensor parallelism and DDP / ZeRO-1
over the data group.

* The layer list (``layers_of(model)``) is cut into ``pipeline x virtual_stages`` stages by the recipe's
  partition method (:mod:`plugin.pipeline_parallel.stages`, DeepSpeed's cuts, counted before tensor sharding);
  pipeline rank ``r`` holds stages ``r, r + pipeline, ...``. Each stage is a :class:`StageModule` (its layers, named by
  their index in the layer list) inside a ``PipelineStage`` on the pipeline group.
* Schedules: ``"gpipe"`` -> ``ScheduleGPipe``, ``"1f1b"`` -> ``Schedule1F1B``, ``"interleaved_1f1b"`` ->
  ``ScheduleInterleaved1F1B`` (``virtual_stages`` chunks per rank), with ``n_microbatches = grad_accum``; the
  schedule divides the accumulated gradients by the micro-batch count, like DeepSpeed's loss scaling.
* A weight tied across stages (embedding and head): one copy per holding rank, equal at start, gradients summed
  over the holders before the step, counted once in the norm (:mod:`.tied`, Megatron's embedding group).
* Data parallelism: each stage module is wrapped in DDP over the data group (:func:`.common.wrap_ddp`; the stages
  all-reduce at their last backward); ZeRO-1 adds ``ZeroRedundancyOptimizer`` over the same group. ZeRO-2/3 with
  pipeline > 1 is refused by the recipe checks (as DeepSpeed refuses it).
* ``activation_checkpointing`` ``{"mode": "full", "every": k}``: every k consecutive layers of a stage run under
  torch's non-reentrant checkpoint, as DeepSpeed's PipelineModule checkpoints layer ranges, the recompute
  replaying the tensor-parallel dropout streams: :func:`plugin.engines.recompute.run_layers`, the loop a whole
  model runs at pipeline 1 too. ``"selective"`` is set in the model's attention (:mod:`plugin.engines.recompute`).
* A context axis: "the data group" is data x context here too (:mod:`.data_parallel`), stage by stage.
* MoE layers (:mod:`plugin.expert_parallel`): the experts placed over the expert group as at pipeline 1, reduced
  over the expert-data group after the schedule. Their load-balancing and z terms cannot join a loss that only the
  last stage computes: each layer attaches its term to its output (:class:`plugin.expert_parallel.aux.StageLosses`),
  so that the backward gives the term its gradient, and the reported loss adds the terms the backward saw, summed
  over the pipeline group.
* The loss: the last stage's micro-batch mean, averaged over its data group, broadcast over the pipeline
  group, the same float on every rank (DeepSpeed's ``train_batch`` semantics).

Known limit: the schedules infer activation shapes by running the first micro-batch once more on their first
step (and after each switch between training and evaluation), inside ``torch.random.fork_rng``. That fork
covers torch's default generators, not the plugin's tensor-parallel dropout streams, which therefore move on
by one forward there: with dropout > 0 and tensor parallelism, a resumed run draws other (equally random)
masks than the uninterrupted one. Without dropout (every parity recipe) nothing random is drawn.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ...context_parallel.apply import apply_context_parallel
from ...expert_parallel import apply_expert_parallel, moe_layers
from ...pipeline_parallel.stages import stages_of_rank
from ...tensor_parallel.random import tensor_parallel_rngs
from ..context import BuildContext
from ..recompute import run_layers
from .common import NativeEngine, build_scaler, ids_of, native_optimizer, tensor_sharded_names, wrap_ddp
from .tied import TiedCopies


class StageModule(nn.Module):
    """Consecutive layers of one stage, applied in order; keys are the layers' indices in the full list.

    Under activation checkpointing the recomputation must draw the same dropout masks: torch's checkpoint
    replays the default generators, and :func:`plugin.tensor_parallel.recompute.checkpoint` the tensor-parallel
    streams too (each tensor rank's own dropout stream inside sharded regions), as on DeepSpeed.
    """

    def __init__(self, layers: dict[int, nn.Module], checkpoint_interval: int = 0):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): layer for i, layer in layers.items()})
        self.checkpoint_interval = checkpoint_interval
        self.rngs = tensor_parallel_rngs(self) if checkpoint_interval else []

    def forward(self, *xs):
        # The schedule passes a tuple between stages as separate arguments (a transformers stage list's
        # (hidden, mask, positions)); the layers take it as one tuple, as DeepSpeed's PipelineModule gives it.
        x = xs[0] if len(xs) == 1 else xs
        return run_layers(list(self.layers.values()), x, self.checkpoint_interval, self.rngs)


_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


def virtual_stages(recipe) -> int:
    """Model chunks per pipeline rank: ``virtual_stages`` under interleaved 1F1B, else 1."""
    pp_cfg = recipe.pipeline_parallel
    return pp_cfg.virtual_stages if pp_cfg.schedule == "interleaved_1f1b" else 1


class PipelineEngine(NativeEngine):
    checks_rows_after_backward = True  # the schedule runs forward and backward; the engine steps after it

    def __init__(self, *args, schedule, stages, loss_fn: Callable, tied: TiedCopies | None = None, moe=None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.moe = moe  # this rank's MoE layers' terms (plugin.expert_parallel.aux.StageLosses), or None
        self.tied = tied or TiedCopies([])
        self.norm_skip = self.tied.replicas
        self.schedule, self.stages, self.loss_fn = schedule, stages, loss_fn
        self.virtual_stages = len(stages)
        self.holds_first = any(s.is_first for s in stages)
        self.holds_last = any(s.is_last for s in stages)

    def micro_batch_modules(self) -> list:
        """The stages' modules (DDP-wrapped at data > 1): the schedule runs each once per micro-batch."""
        return [stage.submod for stage in self.stages]

    def scaled_loss(self, output, labels):
        """The schedule's loss_fn: the loss scaled for backward (fp16). The schedule also calls it on
        placeholder tensors while it infers shapes, so losses are read from its ``losses`` list, not here."""
        return self.scale(self.loss_fn(output, labels))

    def _run(self, batch, train: bool) -> float:
        inputs, labels = self.local_batch(batch)
        losses: list[torch.Tensor] = []
        first = self.first_stage_input(inputs)
        args = (first if isinstance(first, tuple) else (first,)) if self.holds_first else ()
        target = labels if self.holds_last else None
        for stage in self.stages:
            stage.submod.train(train)
        with self.autocast():
            if train:
                self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
            else:
                self.schedule.eval(*args, target=target, losses=losses)
        if losses:
            scale = float(self.scaler.get_scale()) if self.scaler is not None else 1.0  # a power of 2: exact
            loss = torch.stack([m.detach().float() for m in losses]).mean() / scale
        else:
            loss = torch.zeros((), device=self.device)
        if self.holds_last and self.groups.data_context_size > 1:
            dist.all_reduce(loss, group=self.groups.data_context_group)
            loss /= self.loss_replicas
        last = self.groups.pipeline_ranks[-1]
        loss = loss.reshape(1).to(self.device)
        dist.broadcast(loss, src=last, group=self.groups.pipeline_group)
        if self.moe is not None and train:  # the MoE terms every stage carried, per micro-batch, summed over stages
            terms = self.moe.mean_value(self.layout.grad_accum).reshape(1).to(self.device)
            dist.all_reduce(terms, group=self.groups.pipeline_group)
            loss = loss + terms
        return float(loss.item())

    def _train_step(self, batch) -> float:
        loss = self._run(batch, train=True)
        self.rows_checked()  # the data contract's verdict: after the schedule's forward and backward, before the update
        self.tied.sum_grads()
        self.reduce_expert_grads()
        self.optimizer_step()
        return loss

    @torch.no_grad()
    def eval_step(self, batch) -> float:
        return self._run(batch, train=False)


def build_pipeline(ctx: BuildContext, groups, bounds: list[int], ties=()) -> PipelineEngine:
    """Stages of ``ctx.model`` on this rank's pipeline group; ``bounds`` and ``ties``: the cut and the weights tied
    across it (:func:`plugin.pipeline_parallel.checks.check_stage_cut`), made before any process group existed."""
    from torch.distributed import pipelining

    recipe, layout, device = ctx.recipe, ctx.layout, ctx.device
    pp_cfg = recipe.pipeline_parallel
    virtual = virtual_stages(recipe)
    num_stages = layout.pipeline * virtual
    if layout.tensor > 1:
        ctx.apply_tp(ctx.model, groups.tensor_group, pp_rank=groups.pp_rank)
    apply_context_parallel(ctx.model, groups, recipe.context_parallel.method)
    if moe_layers(ctx.model):  # each rank's experts, cut on meta too (materialising fills them from the whole values)
        apply_expert_parallel(ctx.model, groups, getattr(ctx.apply_tp, "cuts", None),
                              recipe.tensor_parallel.sequence_parallel)
    layers = ctx.layers_of(ctx.model)  # the same objects, now sharded
    mine = stages_of_rank(groups.pp_rank, layout.pipeline, virtual)
    modules = {s: StageModule({i: layers[i] for i in range(bounds[s], bounds[s + 1])},
                              recipe.activation_checkpointing.interval) for s in mine}
    container = nn.ModuleDict({str(s): m for s, m in modules.items()})
    if ctx.on_meta:  # this rank's stages only: the other stages' layers stay on meta here
        ctx.materialize(held={id(t) for t in [*container.parameters(), *container.buffers()]})
    container.to(device)
    tied = TiedCopies.build(ties, layers, {i for s in mine for i in range(bounds[s], bounds[s + 1])}, groups,
                            layout.pipeline, timeout=ctx.pg_timeout)
    tied.broadcast_values()
    sharded_names = tensor_sharded_names(container)
    replicas = groups.data_context_size  # ranks holding the same stage: data x context
    zero1 = recipe.zero.stage == 1 and replicas > 1
    optimizer = native_optimizer(container, recipe, groups, zero1=zero1, decay=ctx.decay)
    stages = []
    for s, module in modules.items():
        if replicas > 1:
            module = wrap_ddp(module, groups, device)
            # The stage all-reduces at its last backward by preparing DDP's reducer itself. Any other forward
            # with gradients on (the schedule's shape inference on its first step) must not arm the reducer,
            # or DDP records every gradient twice and fails at the next step ("rebuilt parameter indices").
            module.require_backward_grad_sync = False
        stages.append(pipelining.PipelineStage(module, s, num_stages, device, group=groups.pipeline_group))
    engine = PipelineEngine(recipe, layout, ctx.topology, groups, container, device, container=container,
                            optimizer=optimizer, scaler=build_scaler(recipe, device),
                            tensor_sharded=ids_of(container, sharded_names), schedule=None, stages=stages,
                            loss_fn=ctx.loss_for(groups.tensor_group), tied=tied)
    if moe_layers(ctx.model):  # every rank joins the sum of the terms over the pipeline group, held or not
        from ...expert_parallel.aux import StageLosses

        engine.moe = StageLosses(moe_layers(container),
                                 lambda: float(engine.scaler.get_scale()) if engine.scaler is not None else 1.0)
    cls = getattr(pipelining, _SCHEDULES[pp_cfg.schedule])
    target = stages if pp_cfg.schedule == "interleaved_1f1b" else stages[0]
    engine.schedule = cls(target, n_microbatches=layout.grad_accum, loss_fn=engine.scaled_loss)
    return engine
