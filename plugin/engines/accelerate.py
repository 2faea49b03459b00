"""Accelerate's own ``Accelerator`` under ``accelerate launch``, for recipes it can carry (tensor = pipeline = 1;
:func:`plugin.engines.choose.accelerate_mode` decides, anything else runs the native back end).

The Accelerator is fed from the recipe, not from the launch flags:

* ``device``: CPU unless CUDA is there (``cpu=True``: without it, ``--multi_gpu`` on CPU runs N copies that
  never talk), ``mixed_precision`` from ``precision``, ``gradient_accumulation_steps = grad_accum``.
* ``"ddp"`` (ZeRO-0): Accelerate's DistributedDataParallel (MULTI_CPU on gloo, MULTI_GPU on NCCL); clipping
  through ``accelerator.clip_grad_norm_`` (torch's formula, the same as DeepSpeed's); fp16 on CUDA with a
  ``GradScalerKwargs`` from the recipe's fp16 block.
* ``"deepspeed"`` (ZeRO >= 1, deepspeed and transformers installed: the plugin imports transformers'
  ``HfDeepSpeedConfig``): a ``DeepSpeedPlugin`` whose config is the recipe's export
  (:func:`plugin.engines.deepspeed.config.engine_config`) with the recipe's torch optimizer. On CPU this needs
  ``InitProcessGroupKwargs(backend="gloo")`` and ``cpu=False`` with ``ACCELERATE_USE_CPU`` cleared in this
  process (Accelerate otherwise drops the plugin and runs plain DDP, silently). Under bf16/fp16 DeepSpeed casts
  the model and Accelerate adds no autocast: floating inputs are cast to the model's dtype as they enter
  (:attr:`~plugin.engines.base.Engine.input_dtype`, as on the DeepSpeed engine).
* ``"fsdp"`` (ZeRO-2/3 on CUDA without deepspeed or transformers):
  ``FullyShardedDataParallelPlugin(fsdp_version=2)``, ``reshard_after_forward`` for ZeRO-3, CPU offload from
  the recipe, each transformer layer class wrapped; under bf16/fp16 ``mixed_precision_policy`` reduces in fp32
  (Accelerate's default reduces in the compute dtype).

A model built on the meta device: under the DeepSpeed plugin at ZeRO-3 each unit is made whole, partitioned over
the data group at once (:class:`plugin.materialize.sinks.Zero3Sink`, DeepSpeed's ``zero.Init(module=)``, as the
DeepSpeed engine does) once the Accelerator has made the process group, so no rank holds more than one unit whole;
in every other mode (DDP, ZeRO-1/2, FSDP2) it is materialised whole on every rank, one unit at a time, before
``prepare`` (Accelerate shards a whole model there): those modes need the whole model's bytes on each rank. Before
materialising, every rank's seed is checked to be the same (:mod:`plugin.materialize.same_seed`).

Rank 0 prints which of these carries the recipe, and why. After the Accelerator exists, its distributed type
and process count are asserted against the launch (Accelerate's silent traps exit 0 with unsynchronised
copies). Checkpoints are the checkpoint room's format (:mod:`plugin.checkpoint`), through the native adapter's
case (DDP) or the DeepSpeed adapter (its DeepSpeed plugin), so they load into any other back end and layout.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

from ..distributed.groups import build_groups
from ..errors import PluginError
from ..interop.precision import PRECISIONS
from ..materialize.sinks import Zero3Sink
from .base import Engine
from .choose import accelerate_mode, importable
from .context import BuildContext
from .deepspeed.config import engine_config
from .native.fsdp import fsdp_units
from .optim import build_optimizer
from .precision import compute_dtype, loss_scaler_kwargs


class AccelerateEngine(Engine):
    backend = "accelerate"

    def __init__(self, recipe, layout, topology, groups, accelerator, model, optimizer, loss_fn: Callable,
                 mode: str):
        super().__init__(recipe, layout, topology, groups, model, accelerator.device)
        self.accelerator, self.model, self.optimizer = accelerator, model, optimizer
        self.loss_fn, self.mode = loss_fn, mode
        if mode == "deepspeed":
            # DeepSpeed casts the module to bf16/fp16 itself and Accelerate does not autocast around it: float
            # inputs must come in that dtype (as on the DeepSpeed engine). Asked of the engine, not re-derived.
            model_dtype, _ = accelerator.deepspeed_engine_wrapped.engine.get_data_types()
            self.input_dtype = None if model_dtype == torch.float32 else model_dtype

    def _train_step(self, batch) -> float:
        acc, clip = self.accelerator, float(self.recipe.gradient_clipping)
        self.model.train()
        losses = []
        for inputs, labels in self.micro_batches(batch):
            with acc.accumulate(self.model):
                loss = self.loss_fn(self.call_model(self.model, inputs), labels)
                self.rows_checked()  # a no-op: local_batch took the verdict (Accelerate cannot discard a step)
                acc.backward(loss)  # divides by grad_accum (DeepSpeed: its own backward does)
                if acc.sync_gradients and self.mode != "deepspeed":  # DeepSpeed clips itself
                    # torch's norm, returned; max_norm inf (no clipping) still measures it (its scale factor is 1)
                    norm = acc.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
                    self.last_grad_norm = float(norm)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach().float())
        self.step_count += 1
        return self.mean_over_data(torch.stack(losses).mean())

    def schedule_optimizer(self):
        if self.mode == "deepspeed":
            return self.ds.basic_optimizer  # the torch optimizer passed to prepare, stepped by DeepSpeed's wrappers
        return getattr(self.optimizer, "optimizer", self.optimizer)  # inside Accelerate's wrapper

    def grad_norm(self) -> float | None:
        return self.ds.get_global_grad_norm() if self.mode == "deepspeed" else getattr(self, "last_grad_norm", None)

    @torch.no_grad()
    def eval_step(self, batch) -> float:
        self.model.eval()
        losses = [self.loss_fn(self.call_model(self.model, x), y).detach().float()
                  for x, y in self.micro_batches(batch)]
        return self.mean_over_data(torch.stack(losses).mean())

    # ------------------------------------------------------------------ checkpoints (plugin/checkpoint/)
    # The checkpoint room's format, as on the other back ends: Accelerate's DDP holds whole parameters and a torch
    # optimizer (the native adapter's case), its DeepSpeed plugin a DeepSpeed engine (the DeepSpeed adapter's).
    def save(self, directory: str, client_state: dict | None = None, *, keep: int | None = None):
        from ..checkpoint import adapt

        self._check_checkpointable()
        return adapt.save(self, directory, client_state, keep=keep)

    def load(self, directory: str) -> dict:
        from ..checkpoint import adapt

        self._check_checkpointable()
        return adapt.load(self, directory)

    @property
    def ds(self):
        return self.accelerator.deepspeed_engine_wrapped.engine

    @property
    def scaler(self):
        return self.accelerator.scaler

    def named_local_params(self) -> dict:
        if self.mode == "deepspeed":
            from .deepspeed import state

            return state.named_local_params(self)
        return dict(self.whole_model.named_parameters())

    def local_optimizer(self):
        if self.mode == "deepspeed":
            from .deepspeed import state

            return state.local_optimizer(self)
        return getattr(self.optimizer, "optimizer", self.optimizer)  # inside Accelerate's wrapper

    def checkpoint_pieces(self, name, p, global_shape, key):
        if self.mode != "deepspeed":
            from ..checkpoint.adapt import pieces_of
            from ..checkpoint.boxes import TensorLayout

            return pieces_of(p, global_shape, self.tp_layouts.get(name, TensorLayout()), 0, 1)
        from .deepspeed import state

        return state.checkpoint_pieces(self, name, p, global_shape, key)

    def checkpoint_extra(self, params, for_load):
        if self.mode != "deepspeed":
            return {}, []
        from .deepspeed import state

        return state.extra_entries(self, params, for_load)

    def _check_checkpointable(self):
        if self.mode == "deepspeed":  # its DeepSpeed plugin: what the DeepSpeed adapter cannot hold is refused alike
            from .deepspeed import state

            state.check_checkpointable(self)

    def before_load(self):
        if self.mode == "deepspeed":
            from .deepspeed import state

            state.before_load(self)

    def after_load(self, manifest):
        if self.mode == "deepspeed":
            from .deepspeed import state

            state.after_load(self, manifest)

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds (:mod:`plugin.engines.memory`), as for the other back ends."""
        from .memory import deepspeed_state_bytes, held_bytes

        if self.mode == "deepspeed":
            return deepspeed_state_bytes(self.accelerator.deepspeed_engine_wrapped.engine)
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # inside Accelerate's wrapper
        return held_bytes(self.accelerator.unwrap_model(self.model), optimizer)


def _fsdp_precision(recipe) -> dict | None:
    """Accelerate's FSDP2 plugin reduces gradients in the compute dtype by default (``reduce_dtype=bf16``): in fp32
    here, as the native back end's FSDP2 and DeepSpeed's bf16 do (:mod:`plugin.engines.native.fsdp`)."""
    dtype = compute_dtype(recipe)
    return {"param_dtype": dtype, "reduce_dtype": torch.float32} if dtype is not None else None


def _plugins(mode: str, recipe, world_size: int, cuda: bool, model, layers_of: Callable, timeout) -> dict:
    from accelerate.utils import GradScalerKwargs, InitProcessGroupKwargs

    # the process group's timeout (the recipe's watchdog); on CPU under the DeepSpeed plugin also gloo (see below)
    init = {"timeout": timeout, **({"backend": "gloo"} if mode == "deepspeed" and not cuda else {})}
    kwargs: dict = {"kwargs_handlers": [InitProcessGroupKwargs(**init)]}
    if recipe.precision == "fp16" and mode != "deepspeed":  # DeepSpeed scales the loss itself, from the ds_config
        kwargs["kwargs_handlers"].append(GradScalerKwargs(**loss_scaler_kwargs(recipe)))
    if mode == "deepspeed":
        from accelerate.utils import DeepSpeedPlugin

        config = engine_config(recipe, world_size, use_ds_optimizer=False,
                               numels=tuple(p.numel() for p in model.parameters()))
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=config)
        if not cuda:
            os.environ["ACCELERATE_USE_CPU"] = "false"  # else Accelerate forces cpu=True and drops the plugin
    elif mode == "fsdp":
        from accelerate.utils import FullyShardedDataParallelPlugin
        from torch.distributed.fsdp import CPUOffloadPolicy

        layer_classes = fsdp_layer_classes(model, layers_of)
        z = recipe.zero
        offload = "cpu" in (z.offload_param, z.offload_optimizer)
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            fsdp_version=2, reshard_after_forward=z.stage == 3,
            cpu_offload=CPUOffloadPolicy() if offload else False, state_dict_type="SHARDED_STATE_DICT",
            auto_wrap_policy="transformer_based_wrap" if layer_classes else "no_wrap",
            transformer_cls_names_to_wrap=layer_classes or None, mixed_precision_policy=_fsdp_precision(recipe))
    else:
        kwargs["cpu"] = not cuda
    return kwargs


def fsdp_layer_classes(model, layers_of: Callable) -> list[str]:
    """The class names Accelerate's FSDP2 plugin wraps one by one (``transformer_cls_names_to_wrap``): the classes
    of the native back end's units (:func:`plugin.engines.native.fsdp.fsdp_units`), so a transformers model's
    ``_no_split_modules`` that it holds, the reference GPT's ``Block``."""
    return sorted({type(m).__name__ for m in fsdp_units(model, layers_of)})


def _check_accelerator(acc, mode: str, world_size: int) -> None:
    from accelerate.utils import DistributedType as T

    want = {"ddp": {T.MULTI_CPU, T.MULTI_GPU} if world_size > 1 else {T.NO, T.MULTI_CPU, T.MULTI_GPU},
            "deepspeed": {T.DEEPSPEED}, "fsdp": {T.FSDP}}[mode]
    if acc.num_processes != world_size or acc.distributed_type not in want:
        raise PluginError(
            f"Accelerate set up {acc.distributed_type.value} with {acc.num_processes} process(es), but this launch "
            f"has {world_size} and the recipe needs {' or '.join(sorted(t.value for t in want))} -> launch with "
            f"`accelerate launch --multi_gpu --num_processes {world_size}` (on CPU also ACCELERATE_USE_CPU=true), "
            "not --cpu (one process), or use torchrun")


def build(ctx: BuildContext) -> AccelerateEngine:
    """``ctx.model`` prepared by an ``Accelerator`` in the mode :func:`plugin.engines.choose.accelerate_mode` picks."""
    from accelerate import Accelerator

    model, recipe, layout, env = ctx.model, ctx.recipe, ctx.layout, ctx.env
    cuda = ctx.device.type == "cuda"
    mode, why = accelerate_mode(recipe, cuda=cuda, has_deepspeed=importable("deepspeed"),
                                has_transformers=importable("transformers"))
    if mode is None:
        fix = "pip install transformers, or " if "transformers is not installed" in why else ""
        raise PluginError(f"Accelerate cannot carry this recipe: {why} -> {fix}let initialize choose the back end")
    if env.is_main:
        print(f"{recipe.source or recipe.name}: note: accelerate launch: {why}", file=sys.stderr, flush=True)
    plugins = _plugins(mode, recipe, env.world_size, cuda, model, ctx.layers_of, ctx.pg_timeout)
    acc = Accelerator(mixed_precision=PRECISIONS[recipe.precision].accelerate,
                      gradient_accumulation_steps=layout.grad_accum, **plugins)
    _check_accelerator(acc, mode, env.world_size)
    ctx.joined()  # the hang guard starts, and checks that every rank runs this recipe at this layout
    if mode == "deepspeed":
        from .shm import release_mapped_shm_buffer

        release_mapped_shm_buffer()  # DeepSpeed's CPU all-reduce buffer: no end of the job leaves it in /dev/shm
    groups = build_groups(ctx.topology, timeout=ctx.pg_timeout)
    if ctx.on_meta and mode == "deepspeed" and recipe.zero.stage == 3:
        # as on the DeepSpeed engine: each unit partitioned over the world as it is made (zero.Init(module=)),
        # one unit whole at a time; prepare's deepspeed.initialize then finds the parameters partitioned
        config = plugins["deepspeed_plugin"].deepspeed_config
        ctx.materialize(sink=Zero3Sink(model, config, groups.data_group, None, compute_dtype(recipe), ctx.device))
    elif ctx.on_meta:  # whole, one unit at a time (Accelerate's DDP, ZeRO-1/2 and FSDP2 shard a whole model)
        ctx.materialize()
    loss_fn = ctx.loss_for(groups.tensor_group)
    optimizer = build_optimizer(model.parameters(), recipe.optimizer, ctx.decay)  # groups from the whole model
    if mode == "deepspeed":  # DeepSpeed keeps the last engine's mpu (a pipeline's grid too) as a module global
        from deepspeed.utils import groups as ds_groups

        ds_groups.mpu = None  # Accelerate passes none: its engine would read that one
    prepared, optimizer = acc.prepare(model, optimizer)
    return AccelerateEngine(recipe, layout, ctx.topology, groups, acc, prepared, optimizer, loss_fn, mode)
