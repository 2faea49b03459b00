"""What the native engines share: joining the rendezvous, the optimizer (ZeRO-1 included), the one DDP wrap, the
fp16 loss scaler, the optimizer step (unscale, global-norm clip, step), checkpoints and the bytes a rank holds.

Precision (the recipe's ``precision`` and ``fp16`` block):

* fp32: nothing.
* bf16 / fp16 with DDP, ZeroRedundancyOptimizer, ZeRO-2's row shards or pipeline stages: ``torch.autocast`` around
  forward and loss, fp32 parameters, gradients and optimizer states (as DeepSpeed's bf16 keeps fp32 master weights).
* bf16 / fp16 with FSDP2 (ZeRO-3; ZeRO-2 with optimizer offload): ``MixedPrecisionPolicy(param_dtype=bf16|fp16,
  reduce_dtype=fp32)``,
  fp32 sharded parameters, the root's output cast back to fp32 for the loss.
* fp16: a ``ShardedGradScaler`` (torch's loss scaler that agrees on overflow across every rank, so all
  ranks skip the same steps), its arguments from :func:`plugin.engines.precision.loss_scaler_kwargs`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ...distributed.clipping import clip_by_global_norm
from ..base import Engine
from ..choose import accelerate_mode, importable, launched_by_accelerate
from ..optim import build_optimizer, optimizer_class_and_kwargs
from ..precision import compute_dtype, loss_scaler_kwargs
from . import state


def init_process_group(device: torch.device, timeout=None) -> None:
    """Join the launcher's rendezvous (env://): NCCL on CUDA, gloo on CPU; ``timeout`` bounds the rendezvous and every
    collective of the default group (the recipe's ``watchdog``)."""
    if not dist.is_initialized():
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device, timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)


def tensor_sharded_names(module: torch.nn.Module) -> set[str]:
    return {n for n, p in module.named_parameters() if getattr(p, "tensor_model_parallel", False)}


def ids_of(module: torch.nn.Module, names: set[str]) -> set[int]:
    """Ids of the parameters called ``names`` now (FSDP2 replaces parameters by DTensor ones)."""
    return {id(p) for n, p in module.named_parameters() if n in names}


def native_optimizer(module, recipe, groups, zero1: bool, decay):
    """The recipe's torch optimizer, or ZeroRedundancyOptimizer over the data (x context) group for ZeRO-1, over
    ``module``'s parameters grouped by ``decay`` (:class:`plugin.engines.optim.WeightDecay`, decided on the whole
    model). ZeRO-1 with an expert axis: the experts' states over the expert-data group, the rest's over data x
    context, stepped as one (:class:`.optimizers.Optimizers`)."""
    if not zero1:
        return build_optimizer(module.parameters(), recipe.optimizer, decay)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from ...expert_parallel import is_expert_param

    cls, kwargs = optimizer_class_and_kwargs(recipe.optimizer)

    def zero(params, group, size):
        if size == 1:  # no rank to partition over (expert 4 over data 4: each rank its own experts)
            return build_optimizer(params, recipe.optimizer, decay)
        return ZeroRedundancyOptimizer(decay.groups(params, recipe.optimizer.weight_decay), optimizer_class=cls,
                                       process_group=group, parameters_as_bucket_view=True,  # one broadcast a rank
                                       **kwargs)

    if groups.ep_size == 1:
        return zero(module.parameters(), groups.data_context_group, groups.data_context_size)
    from .optimizers import Optimizers

    experts = [p for p in module.parameters() if is_expert_param(p)]
    rest = [p for p in module.parameters() if not is_expert_param(p)]
    return Optimizers([zero(rest, groups.data_context_group, groups.data_context_size),
                       zero(experts, groups.expert_data_group, groups.edp_size)])


def why_not_accelerate(recipe, environ: Mapping[str, str], cuda: bool) -> str | None:
    """Under ``accelerate launch``, the note that says why the native back end trains rather than Accelerate
    itself (:func:`plugin.engines.choose.accelerate_mode`'s reason); None elsewhere, or when the recipe's
    ``launcher`` field chose native."""
    if not launched_by_accelerate(environ) or recipe.launcher not in ("auto", "accelerate"):
        return None
    mode, why = accelerate_mode(recipe, cuda=cuda, has_deepspeed=importable("deepspeed"),
                                has_transformers=importable("transformers"))
    if mode:
        return None
    return f"{recipe.source or recipe.name}: note: accelerate launch: the native back end trains ({why})"


def build_scaler(recipe, device: torch.device):
    """The fp16 loss scaler from the recipe's fp16 block (None unless precision is fp16): a ``ShardedGradScaler``,
    torch's loss scaler that agrees on overflow across every rank, so all ranks skip the same steps."""
    if recipe.precision != "fp16":
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    scaler = ShardedGradScaler(device=device.type, process_group=dist.group.WORLD, **loss_scaler_kwargs(recipe))
    scaler.scale(torch.zeros((), device=device))  # create the scale on every rank, even where no loss is computed
    return scaler


def wrap_ddp(module: torch.nn.Module, groups, device: torch.device):
    """``module`` in DistributedDataParallel over the data group (data x context with a context axis: every rank
    holding the same parameters averages its gradients): every native engine's one DDP wrap."""
    from torch.nn.parallel import DistributedDataParallel

    from ...expert_parallel import is_expert_param

    if groups.ep_size > 1:  # the experts differ across data x context: reduced over the expert-data group instead
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            module, [n for n, p in module.named_parameters() if is_expert_param(p)])
    return DistributedDataParallel(module, process_group=groups.data_context_group,
                                   device_ids=[device] if device.type == "cuda" else None,
                                   gradient_as_bucket_view=True,  # gradients are views into DDP's buckets: no copy
                                   # a routed model (mixture of experts): an expert that gets no token on one rank
                                   # has no gradient there, and without this its bucket's all-reduce waits forever
                                   # (longcat_flash at tensor 2 x data 2 hung in backward)
                                   find_unused_parameters=routed(module))


def routed(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds a mixture-of-experts block (a submodule class named ``*Expert*`` or ``*MoE*``, as
    transformers' are), whose parameters a step may leave without a gradient on one rank. The plugin's own
    (:mod:`plugin.expert_parallel`) are not: every local expert runs every step, on zero rows if need be."""
    return any(("expert" in type(m).__name__.lower() or "moe" in type(m).__name__.lower())
               and not type(m).__module__.startswith("plugin.expert_parallel") for m in module.modules())


class NativeEngine(Engine):
    """The optimizer step and the checkpoint of every native engine.

    Subclasses set ``container`` (an ``nn.Module`` whose parameters are exactly this rank's), ``optimizer``,
    ``scaler``, ``tensor_sharded`` (ids of tensor-sharded parameters), ``data_sharded`` (each rank holds a piece of
    every gradient: FSDP2's DTensors, ZeRO-2's row shards).
    """

    backend = "native"
    virtual_stages = 1
    data_sharded = False
    fsdp = False  # FSDP2 (ZeRO-3, ZeRO-2 with offload): its MixedPrecisionPolicy casts, no autocast
    norm_skip: frozenset = frozenset()  # ids of copies of a tied weight counted on another rank (pipeline.py)

    def __init__(self, recipe, layout, topology, groups, module, device, *, container, optimizer, scaler,
                 tensor_sharded: set):
        super().__init__(recipe, layout, topology, groups, module, device)
        from ...expert_parallel import is_expert_param

        # with an expert axis: this rank's experts, reduced over the expert-data group (plugin.expert_parallel.grads)
        self.expert_params = [p for p in container.parameters() if is_expert_param(p)] if groups.ep_size > 1 else []
        self.container = container
        self.optimizer = optimizer
        self.scaler = scaler
        self.tensor_sharded = tensor_sharded
        self.dtype = compute_dtype(recipe)
        self.last_grad_norm: float | None = None

    def schedule_optimizer(self):
        return self.optimizer  # ZeroRedundancyOptimizer hands its groups' lr to the local optimizer at each step

    def autocast(self):
        """Autocast for engines that keep fp32 parameters (FSDP2 casts through its policy instead)."""
        if self.dtype is None or self.fsdp or self.device.type == "meta":  # meta: the dry run (no autocast there)
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def optimizer_step(self) -> None:
        """Unscale (fp16), clip by the global norm, step (skipped by the scaler on overflow), zero grads."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # first: the norm is clipped on the true gradients, not scaled ones
        params = self.clip_params()
        experts = bool(self.expert_params)  # FSDP2's expert shards: summed over data x context, each counted once
        norm = clip_by_global_norm(
            params, float(self.recipe.gradient_clipping), tensor_sharded=self.tensor_sharded,
            tp_rank=self.groups.tp_rank, model_group=self.groups.model_group,
            model_size=self.groups.model_size,
            data_group=self.groups.data_context_group if self.groups.data_context_size > 1 else None,
            data_sharded=self.data_sharded, device=self.device, skip=self.norm_skip,
            expert={id(p) for p in self.expert_params}, expert_group=self.groups.expert_group if experts else None)
        self.last_grad_norm = float(norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1

    def reduce_expert_grads(self) -> None:
        """The experts' gradients summed over the expert-data group, over data x context (once per step, after the
        last backward): :func:`plugin.expert_parallel.grads.reduce_expert_grads`."""
        if self.expert_params:
            from ...expert_parallel.grads import reduce_expert_grads

            group = self.groups.expert_data_group if self.groups.edp_size > 1 else None
            reduce_expert_grads(self.expert_params, group, self.groups.data_context_size)

    def clip_params(self) -> list:
        """The tensors whose gradients the optimizer steps with: this rank's parameters (ZeRO-2: its row views)."""
        return list(self.container.parameters())

    def discard_step(self) -> None:
        """A step refused after its backward (the data contract): its gradients dropped, nothing updated."""
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory: str, client_state: dict | None = None, *, keep: int | None = None):
        return state.save(self, directory, client_state, keep=keep)

    def named_local_params(self) -> dict:
        return state.named_local_params(self)

    def local_optimizer(self):
        return state.local_optimizer(self)

    def load(self, directory: str) -> dict:
        return state.load(self, directory)

    # ------------------------------------------------------------------ memory
    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer states, counted as for DeepSpeed
        (:func:`plugin.engines.memory.held_bytes`): this rank's parameters (FSDP2: its shards), their
        gradients (DDP: views into its buckets), the optimizer's states (ZeRO-1: this rank's partition).
        Measure inside a step (after a backward) for gradients to exist."""
        from ..memory import held_bytes

        return held_bytes(self.container, state.local_optimizer(self))
