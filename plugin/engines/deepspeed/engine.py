"""The DeepSpeed back end: ZeRO for the data-parallel replicas, PipelineModule for stages, the plugin's
Megatron-style layers for tensor parallelism, all from one exported ds_config.

* pipeline = 1: ``deepspeed.initialize(model, optimizer, config, mpu=groups)``, the plugin's groups as the
  mpu when tensor > 1 (DeepSpeed then averages gradients over the data group only and counts sharded
  parameters once per tensor rank when it clips).
* pipeline > 1: a ``PipelineModule`` over ``PipeModelDataParallelTopology(num_pp, num_mp=tensor, num_dp)``.
  Its grid is the only grid: the tensor groups are taken from it (``get_slice_parallel_group``), and the
  model is sharded after the module has cut its stage, inside the same layer objects.

A weight tied across stages (embedding and head) is found before any process group exists
(:mod:`plugin.pipeline_parallel.checks`) and its holders handed to the PipelineModule as ``TiedLayerSpec`` entries
(:mod:`.tied`): one copy per holding stage, broadcast at start, gradients all-reduced, counted once in the norm.

Optimizer: the recipe's torch.optim optimizer (fused on CUDA), except DeepSpeed's CPUAdam for an offloaded Adam
on CUDA where that op builds (:mod:`plugin.engines.deepspeed.optimizer`). The exported ds_config is what the
engine runs, but for the keys :data:`.config.ENGINE_ADJUSTED_KEYS` names (the optimizer section, bucket sizes, logging).

Activation checkpointing (the recipe's ``activation_checkpointing``, :mod:`plugin.engines.recompute`): under
pipeline > 1 with ``"full"``, the PipelineModule checkpoints its layer ranges (``activation_checkpoint_interval``
= ``every``) with :func:`plugin.tensor_parallel.recompute.checkpoint` (torch's non-reentrant checkpoint, replaying
the tensor-parallel dropout streams), the native pipeline's function; at pipeline 1, and for ``"selective"``, the
model already recomputes as :func:`plugin.engines.initialize.initialize` set it.

Checkpoints: the checkpoint room's format, DeepSpeed's partitions read in place (:mod:`.state`).

Precision: under bf16 / fp16 DeepSpeed casts the model itself, so floating inputs are cast to that dtype
as they enter (:attr:`~plugin.engines.base.Engine.input_dtype`); integer token ids and labels are not. fp16 at
ZeRO-0 without a pipeline: the engine multiplies the loss by the scale before ``ds.backward``, which DeepSpeed 0.19.8
leaves out for its FP16 optimizers (:func:`.state.unapplied_loss_scale`); a PipelineModule's backward
(``PipelineEngine._exec_backward_pass``) goes through the same ``engine.backward`` with no place for the plugin to
apply it, so fp16 at ZeRO-0 with pipeline > 1 is refused (ZeRO-1 or bf16 instead).
"""
from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable

import torch

from ...context_parallel.apply import apply_context_parallel
from ...distributed.groups import ParallelGroups, build_groups
from ...errors import PluginError
from ...materialize.sinks import Zero3Sink
from ...pipeline_parallel.checks import check_stage_cut
from ...tensor_parallel.random import tensor_parallel_rngs
from ...tensor_parallel.recompute import checkpoint_func
from ..base import Engine
from ..context import BuildContext
from ..optim import build_optimizer
from ..precision import compute_dtype
from ..shm import release_mapped_shm_buffer
from . import state, tied
from .config import engine_config
from .grad_norm import keep_grad_norm
from .optimizer import choose_optimizer


def _stage_class(pipeline_module):
    """A PipelineModule whose constructor's move to the device waits while its stage is on meta: the stage is
    materialised (and tensor-sharded) once its grid exists, then moved."""

    class StageOnMeta(pipeline_module):
        def _synchronize_tied_weights(self):  # in the constructor, on meta tensors: redone once materialised
            if not any(p.device.type == "meta" for p in self.parameters()):
                super()._synchronize_tied_weights()

        def to(self, *args, **kwargs):
            if any(t.device.type == "meta" for t in [*self.parameters(), *self.buffers()]):
                return self
            return super().to(*args, **kwargs)

    return StageOnMeta


def count_each_gradient_once(module, tp_rank: int) -> None:
    """Make DeepSpeed's gradient norm count every parameter of a pipeline exactly once.

    With a PipelineModule, DeepSpeed's "model parallel" group is a whole pipeline (pipeline x tensor ranks)
    and its non-ZeRO clipping counts a parameter only if it is marked model-parallel or the rank is that
    group's rank 0 (first stage, tensor rank 0): the other stages' unsharded parameters would be left out
    of the norm. Marking the unsharded parameters of tensor rank 0 on every stage counts each once; the
    sharded ones (``tensor_model_parallel``) count on every tensor rank, as they should. ZeRO's own norm
    uses the tensor rank and the same marks, so it agrees.
    """
    if tp_rank != 0:
        return
    for p in module.parameters():
        if not getattr(p, "tensor_model_parallel", False):
            p.model_parallel = True


class DeepSpeedEngine(Engine):
    backend = "deepspeed"

    def __init__(self, recipe, layout, topology, groups, ds_engine, loss_fn: Callable, device, pipelined: bool):
        super().__init__(recipe, layout, topology, groups, ds_engine.module, device)
        self.input_dtype = compute_dtype(recipe)  # what DeepSpeed casts the module to under bf16 / fp16
        self.ds = ds_engine
        self.loss_fn = loss_fn
        self.pipelined = pipelined
        self.checks_rows_after_backward = not pipelined  # train_batch updates inside: the verdict before it
        # The plugin's losses are shares of a mean over data x context (the native back end's DDP averages them);
        # DeepSpeed 0.19.8 divides the data x context sum of gradients by data alone at stages 0-2 (a sequence-parallel
        # group's losses are parts of one sum to it: zero/stage_1_and_2.py, engine.py's allreduce), so 1/context
        # makes the two agree; its stage-3 reduce-scatter (the only path config.py leaves it) divides by data x
        # context itself (zero/stage3.py __avg_scatter_grads), as the pipeline engine does over its grid's data axis
        self.sum_scale = 1.0 if recipe.zero.stage == 3 or pipelined else 1.0 / layout.context

    def stage_micro_batches(self, batch) -> list:
        """The PipelineModule's micro-batches: ``(first stage's input, labels)`` each (:meth:`first_stage_input`)."""
        return [(self.first_stage_input(x), y) for x, y in self.micro_batches(batch)]

    def _train_step(self, batch) -> float:
        self.ds.train()
        if self.pipelined:
            micro = self.stage_micro_batches(batch)
            self.rows_checked()  # train_batch runs forward and backward together: the data contract's verdict first
            loss = self.ds.train_batch(data_iter=iter(micro))
            self.step_count += 1
            return float(loss.item())
        micro = self.micro_batches(batch)
        losses, mean_loss = [], None
        scale = state.unapplied_loss_scale(self.ds)
        if self.sum_scale != 1.0:
            scale = (1.0 if scale is None else scale) * self.sum_scale
        for i, (inputs, labels) in enumerate(micro):
            loss = self.loss_fn(self.call_model(self.ds, inputs), labels)
            losses.append(loss.detach().float())
            if i == len(micro) - 1:  # every loss is known: average them while the last backward runs
                mean_loss = self.start_mean_over_data(torch.stack(losses).mean())
            self.ds.backward(loss if scale is None else loss.float() * scale)
            if i == len(micro) - 1:
                self.rows_checked()  # the data contract's verdict: after the backward, before the update (step)
            self.ds.step()
        self.step_count += 1
        return mean_loss()

    def discard_step(self) -> None:
        """A step refused after its last backward (the data contract): its gradients dropped, and the micro-step that
        ``ds.step()`` would have counted counted, so the next step's accumulation boundary falls where it should
        (measured at ZeRO 0-3, grad_accum 1 and 2: the next steps' losses equal those of a run without the refusal)."""
        self.ds.optimizer.zero_grad()
        self.ds.micro_steps += 1

    def schedule_optimizer(self):
        return self.ds.basic_optimizer  # the torch optimizer DeepSpeed's ZeRO / bf16 / fp16 wrappers step

    def grad_norm(self) -> float | None:
        return self.ds.get_global_grad_norm()  # the norm DeepSpeed clipped with (grad_norm.py: ZeRO-0 fp32 too)

    @torch.no_grad()
    def eval_step(self, batch) -> float:
        self.ds.eval()
        if self.pipelined:
            loss = self.ds.eval_batch(data_iter=iter(self.stage_micro_batches(batch)),
                                      num_micro_batches=self.layout.grad_accum)
            return float(loss.item())
        losses = [self.loss_fn(self.call_model(self.ds, x), y).detach().float() for x, y in self.micro_batches(batch)]
        return self.mean_over_data(torch.stack(losses).mean())

    # ------------------------------------------------------------------ checkpoints (plugin/checkpoint/)
    def save(self, directory: str, client_state: dict | None = None, *, keep: int | None = None):
        """The checkpoint room's format (:mod:`.state`): DeepSpeed's partitions as pieces of the unsharded tensors,
        so any layout and the native back end read it."""
        from ...checkpoint import adapt

        state.check_checkpointable(self)
        return adapt.save(self, directory, client_state, keep=keep)

    def load(self, directory: str) -> dict:
        from ...checkpoint import adapt

        state.check_checkpointable(self)
        return adapt.load(self, directory)

    @property
    def scaler(self):
        """fp16's loss scaler as checkpoint state (:class:`.state.LossScale`), None otherwise."""
        return state.loss_scale(self)

    def named_local_params(self) -> dict:
        return state.named_local_params(self)

    def local_optimizer(self):
        return state.local_optimizer(self)

    def checkpoint_pieces(self, name, p, global_shape, key):
        return state.checkpoint_pieces(self, name, p, global_shape, key)

    def clear_optimizer_state(self):
        state.clear_optimizer_state(self)

    def checkpoint_extra(self, params, for_load):
        return state.extra_entries(self, params, for_load)

    def before_load(self):
        state.before_load(self)

    def after_load(self, manifest):
        state.after_load(self, manifest)

    def state_bytes(self) -> dict[str, int]:
        from ..memory import deepspeed_state_bytes

        return deepspeed_state_bytes(self.ds)


def build(ctx: BuildContext) -> DeepSpeedEngine:
    """Wrap ``ctx.model`` per ``ctx.recipe``: ``ctx.apply_tp(model, tp_group)`` shards it, ``ctx.layers_of(model)``
    lists its layers for a pipeline, ``ctx.loss_for(tp_group)`` gives the loss function."""
    model, recipe, layout, device = ctx.model, ctx.recipe, ctx.layout, ctx.device
    layers_of, apply_tp, loss_for = ctx.layers_of, ctx.apply_tp, ctx.loss_for
    if layout.pipeline > 1 and recipe.precision == "fp16" and int(recipe.zero.stage or 0) == 0:
        # the pipeline engine's backward is DeepSpeed's engine.backward, which leaves the loss unscaled for its
        # FP16 optimizers while their step divides by the scale (state.unapplied_loss_scale; train_batch gives the
        # plugin no place to apply it): measured pp2 at 2**18, 6 steps, no overflow and the scale never moved, where
        # ZeRO-1 overflowed twice
        raise PluginError("DeepSpeed's pipeline engine trains fp16 at ZeRO-0 with an unscaled loss whose gradients "
                          "its FP16 optimizer then divides by the loss scale (DeepSpeed 0.19.8: updates shrink by the "
                          'scale, exit 0) -> set "zero": {"stage": 1} (its ZeRO optimizer scales the loss), '
                          '"precision": "bf16", or use the native back end')
    if layout.pipeline > 1:  # before any process group: every rank refuses alike, nothing hangs
        bounds, ties = check_stage_cut(layers_of(model), recipe.pipeline_parallel.partition, layout.pipeline,
                                       "DeepSpeed's PipelineModule")
        tied.check_ties(ties, layers_of(model))
    # DeepSpeed settles its accelerator once, on first use (get_accelerator, reached by the import below): name the
    # device this engine runs on, so the two agree (on CPU it also spares DeepSpeed's detection warning). A value the
    # user exported wins.
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
    # DeepSpeed 0.19 still calls torch's deprecated all_gather_into_tensor and reduce_scatter_tensor (ZeRO-3): one
    # warning per rank, nothing to act on
    warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor). is deprecated",
                            category=FutureWarning)
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False,
                               timeout=ctx.pg_timeout)
    ctx.joined()  # the hang guard starts, and checks that every rank runs this recipe at this layout
    release_mapped_shm_buffer()  # DeepSpeed's CPU all-reduce buffer: no end of the job leaves it in /dev/shm
    topology = ctx.topology
    choice = choose_optimizer(recipe, device)
    if choice.note and ctx.env.is_main:
        print(choice.note, file=sys.stderr, flush=True)

    if layout.pipeline > 1:
        from deepspeed.pipe import PipelineModule
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        # the grid's data axis is data x context (context fastest, the plugin's rank order): the pipeline engine
        # reduces gradients over every rank holding the stage and divides them by their count
        ds_topology = PipeModelDataParallelTopology(num_pp=layout.pipeline, num_mp=layout.tensor,
                                                    num_dp=layout.data * layout.context)
        pp = recipe.pipeline_parallel
        module = _stage_class(PipelineModule)(layers=tied.to_specs(layers_of(model), ties, bounds),
                                              topology=ds_topology,
                                              partition_method=pp.partition,
                                              activation_checkpoint_interval=recipe.activation_checkpointing.interval)
        # one grid: its slice group is the tensor group (with a context axis the context groups are made beside it)
        groups = ParallelGroups.from_deepspeed_grid(module._grid, layout.context, timeout=ctx.pg_timeout)
        loss_fn = module.loss_fn = loss_for(groups.tensor_group)
        if layout.tensor > 1:
            apply_tp(model, groups.tensor_group, pp_rank=groups.pp_rank)
            layers_of(model)  # re-syncs a transformers stage list with the sharded modules (hf_stages)
        apply_context_parallel(model, groups, recipe.context_parallel.method)  # nothing at context 1
        count_each_gradient_once(module, groups.tp_rank)  # marks on meta parameters survive materialising
        tied.mark_replicas(module)  # after the tensor-parallel swap, which makes new parameters
        if ctx.on_meta:  # the stage's own layers only (PipelineModule registers no other)
            ctx.materialize(held={id(t) for t in [*module.parameters(), *module.buffers()]})
        module.to(device)
        tied.synchronize(module)  # no-op without ties; under meta init the constructor's broadcast was skipped
        mpu = None  # DeepSpeed requires mpu=None with a PipelineModule; it uses the module's grid
    else:
        groups = build_groups(topology, timeout=ctx.pg_timeout)
        loss_fn = loss_for(groups.tensor_group)
        module = apply_tp(model, groups.tensor_group) if layout.tensor > 1 else model
        apply_context_parallel(module, groups, recipe.context_parallel.method)  # nothing at context 1
        # at tensor 1 and context 1 DeepSpeed's own groups are the plugin's (its data group is the world): no mpu to
        # hand it; a context axis reaches DeepSpeed as its sequence-parallel groups (ParallelGroups' adapter)
        mpu = groups if layout.tensor > 1 or layout.context > 1 else None
        if mpu is None:  # DeepSpeed keeps the last engine's mpu as a module global: a second engine would read it
            from deepspeed.utils import groups as ds_groups

            ds_groups.mpu = None

    # buckets sized to what this rank holds: its stage, its tensor shards (meta shapes: numel is 0 once partitioned)
    numels = tuple(p.numel() for p in module.parameters())
    config = engine_config(recipe, ctx.env.world_size, use_ds_optimizer=choice.deepspeed_op, numels=numels)
    if layout.pipeline == 1:
        if ctx.on_meta and recipe.zero.stage == 3:  # partitioned unit by unit: one unit whole at a time
            # partitioned over data x context: the sequence-data-parallel group the engine's ZeRO-3 partitions over
            ctx.materialize(sink=Zero3Sink(model, config, groups.data_context_group, mpu, compute_dtype(recipe),
                                           device))
        elif ctx.on_meta:
            ctx.materialize()
        if not (ctx.on_meta and recipe.zero.stage == 3):
            module.to(device)
        if recipe.zero.stage == 3 and layout.context > 1 and not ctx.on_meta:
            # deepspeed.initialize would partition a whole model over mpu.get_data_parallel_group() (DeepSpeed
            # 0.19.8 zero/parameter_offload.py, _convert_to_zero_parameters), the data group alone, and reduce its
            # gradients there: each context rank would keep its own chunks' gradient (measured: 0.45-0.76 of one
            # process's per parameter). Partitioned here over data x context, the group the stage-3 optimizer
            # reduces over (as Zero3Sink does under meta init), initialize converts nothing more.
            deepspeed.zero.Init(module=module, config_dict_or_path=config,
                                data_parallel_group=groups.data_context_group, mpu=mpu)
    # the groups decided on the whole model (ctx.decay): under meta init ZeRO-3 has partitioned every parameter by now
    if choice.deepspeed_op:
        optimizer, params = None, ctx.decay.groups(module.parameters(), recipe.optimizer.weight_decay)
    else:
        optimizer, params = build_optimizer(module.parameters(), recipe.optimizer, ctx.decay, fused=choice.fused), None
    ds_engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, model_parameters=params,
                                              config=config, mpu=mpu)
    keep_grad_norm(ds_engine)
    if layout.pipeline > 1 and recipe.activation_checkpointing.interval > 0:
        # After initialize, which installs DeepSpeed's own checkpoint function: that one replays torch's and
        # DeepSpeed's generators but not the tensor-parallel dropout streams, so recomputed masks would differ.
        ds_engine.module.activation_checkpoint_func = checkpoint_func(tensor_parallel_rngs(module))
    return DeepSpeedEngine(recipe, layout, topology, groups, ds_engine, loss_fn, device,
                           pipelined=layout.pipeline > 1)
