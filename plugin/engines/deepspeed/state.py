"""Checkpoints of the DeepSpeed back end through the checkpoint room: DeepSpeed's own partitions as pieces,
read and written in place, without collectives and without whole tensors (no offline conversion).

* ZeRO-0 fp32 (torch's optimizer as DeepSpeed's): whole TP-local parameters and their states, like native DDP.
* ZeRO-0 fp16: DeepSpeed's FP16_Optimizer (a fused Adam: one fp32 flat per parameter group, the module's fp16
  parameters views of an fp16 flat) or FP16_UnfusedOptimizer (any other optimizer, torch's AdamW included: one fp32
  copy per parameter). The torch optimizer steps those fp32 masters and keys its moments by them; the module holds
  fp16 copies. So the masters are written (not the fp16 copies) and their moments, each parameter's range of its
  master (:func:`fp16_masters`); after a load the masters are copied into the fp16 parameters, as DeepSpeed's
  own step ends (its own checkpoint restores both from the files).
* ZeRO-1/2 and the bf16 optimizer: each parameter's ``_hp_mapping`` says which flat range of it this rank's fp32
  partition holds (the address DeepSpeed's universal checkpoint and ``safe_get_full_*`` read); the moments are the
  same range of the flat partition's state. Read through the flat state, never ``get_hp_fragment(key)``: DeepSpeed
  0.19.8 links those fragments after the first parameter group's step only, so a second group's (the no-decay
  biases and norms) is empty (``safe_get_full_optimizer_state`` raises there, and hangs on the ranks without a
  fragment). After a load, ``update_lp_params`` copies the fp32 partitions into the module's parameters.
* ZeRO-3: ``safe_get_local_fp32_param`` / ``safe_get_local_optimizer_state`` (views of the fp32 partition on CPU),
  the real part of the partition ``[dp_rank * part, min((dp_rank + 1) * part, ds_numel))``; after a load the
  partition is copied into ``ds_tensor`` too (what forward gathers: without it a resumed run restarts from the
  initial weights, exit 0), inside ``checkpoint_event_prologue``/``epilogue`` (else the persistent parameters keep
  stale gathered values in an engine that has trained).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...checkpoint.boxes import Entry, Piece, TensorLayout, compose, flat_held, tp_segments


def _zero(engine) -> int:
    return int(engine.ds.zero_optimization_stage())


def named_local_params(engine) -> dict:
    held = {id(p) for p in engine.ds.module.parameters()}
    return {n: p for n, p in engine.whole_model.named_parameters() if id(p) in held}


def local_optimizer(engine):
    """The torch optimizer whose states are keyed by the module's parameters (ZeRO-0 fp32), else None: the
    partitioned optimizers' states go through :func:`extra_entries`."""
    opt = engine.ds.optimizer
    if isinstance(opt, torch.optim.Optimizer) and not hasattr(opt, "optimizer") and _zero(engine) == 0:
        return opt
    return None


def _base(engine):
    return engine.ds.optimizer.optimizer


def fp16_masters(engine) -> dict | None:
    """``{id(fp16 parameter): (parameter, fp32 master tensor, start)}`` under DeepSpeed's fp16 optimizers of ZeRO-0
    (FP16_Optimizer: the parameter's range of its group's ``fp32_groups_flat``, in ``fp16_groups`` order as
    DeepSpeed flattens them; FP16_UnfusedOptimizer: its ``fp32_groups`` copy), else None. The moments of a master
    are the same range of ``optimizer.state[flat or copy]``: :func:`_master_of`."""
    if _zero(engine) != 0:
        return None
    opt = getattr(engine.ds, "optimizer", None)
    groups = getattr(opt, "fp16_groups", None)
    if groups is None:
        return None
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    out = {}
    if isinstance(opt, FP16_Optimizer):
        for group, flat in zip(groups, opt.fp32_groups_flat, strict=True):
            start = 0
            for p in group:
                out[id(p)] = (p, flat, start)
                start += p.numel()
    elif isinstance(opt, FP16_UnfusedOptimizer):
        for group, masters in zip(groups, opt.fp32_groups, strict=True):
            for p, m in zip(group, masters, strict=True):
                out[id(p)] = (p, m, 0)
    else:
        return None
    return out


def unapplied_loss_scale(ds):
    """The loss scale the plugin must apply itself before ``ds.backward``, else None. DeepSpeed 0.19.8's
    ``engine.backward`` scales the loss only for a ZeROOptimizer (``scale_if_loss``; ``runtime/engine.py``
    ``backward``), yet FP16_Optimizer / FP16_UnfusedOptimizer (fp16 at ZeRO-0) divide the gradients by their scale
    in ``step`` (``unscale_and_clip_grads``): unscaled fp16 gradients never overflow, the dynamic scale only grows,
    and every update shrinks by it (measured, dp2, step 4: 0.5 % above the scale-1 run's loss at 2**16, next to
    nothing learnt at 2**30, exit 0). Their own ``backward`` multiplies ``loss.float()`` by this same ``loss_scale``."""
    opt = getattr(ds, "optimizer", None)
    if type(opt).__name__ not in ("FP16_Optimizer", "FP16_UnfusedOptimizer"):
        return None
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    if isinstance(opt, ZeROOptimizer):  # a release that scales it in engine.backward: nothing left to apply
        return None
    return opt.loss_scale


def _master_of(engine, masters: dict, p, key):
    """The fp32 master of fp16 parameter ``p`` (or its state ``key``), shaped like ``p``; None if it has none
    (frozen: DeepSpeed keeps no master for it)."""
    hit = masters.get(id(p))
    if hit is None:
        return None
    _, src, start = hit
    # detached: the masters are leaves that require grad (DeepSpeed sets it), and a load writes into the view
    src = src.detach() if key is None else _base(engine).state[src][key]
    return src.view(-1).narrow(0, start, p.numel()).view(p.shape)


def _z3_range(p):
    part = p.ds_tensor.ds_numel
    start = dist.get_rank(group=p.ds_process_group) * part
    return start, max(0, min(part, p.ds_numel - start))


def _fragment(engine, p, key):
    """(TP-local shape, flat start, flat fragment view) this rank holds of ``p`` (or its state ``key``)."""
    if _zero(engine) == 3:
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

        start, real = _z3_range(p)
        t = safe_get_local_fp32_param(p) if key is None else safe_get_local_optimizer_state(p, key)
        return tuple(p.ds_shape), start, t.narrow(0, 0, real)
    m = getattr(p, "_hp_mapping", None)
    if m is None:
        return tuple(p.shape), 0, None
    flat = _base(engine).param_groups[m.param_group_index]["params"][0]
    src = flat if key is None else _base(engine).state[flat][key]
    return tuple(p.shape), m.lp_fragment_address.start, src.narrow(0, m.hp_fragment_address.start,
                                                                 m.hp_fragment_address.numel)


def checkpoint_pieces(engine, name, p, global_shape, key):
    lay = engine.tp_layouts.get(name, TensorLayout())
    tp_rank, tp_size = engine.groups.tp_rank, engine.layout.tensor
    masters = fp16_masters(engine)
    if masters is not None:  # ZeRO-0 fp16: the fp32 master (and its moments), not the module's fp16 copy
        t = _master_of(engine, masters, p, key)
        if t is None:
            return []
        return compose([((0,) * t.dim(), t)], tp_segments(tuple(t.shape), global_shape, lay, tp_rank, tp_size))
    if local_optimizer(engine) is not None or (_zero(engine) == 0 and getattr(p, "_hp_mapping", None) is None):
        t = p.detach() if key is None else p  # ZeRO-0 fp32: p is the parameter or its state tensor
        return compose([((0,) * t.dim(), t)], tp_segments(tuple(t.shape), global_shape, lay, tp_rank, tp_size))
    shape, start, frag = _fragment(engine, p, key)
    if frag is None or frag.numel() == 0:
        return []
    return compose(flat_held(shape, start, frag), tp_segments(shape, global_shape, lay, tp_rank, tp_size))


def extra_entries(engine, params: dict, for_load: bool):
    """The partitioned optimizers' states (ZeRO-1/2/3, bf16) and ZeRO-0 fp16's: moments as pieces of the flat
    partitions (of the fp32 masters), ``step`` per parameter (DeepSpeed keeps one per flat partition, or per master
    under FP16_UnfusedOptimizer); and what to run after a load."""
    from ...checkpoint.adapt import materialise_optimizer_state

    if local_optimizer(engine) is not None:
        return {}, []
    base = _base(engine)
    if for_load:
        materialise_optimizer_state(base)
    keys = sorted({k for st in base.state.values() for k, v in st.items() if torch.is_tensor(v) and v.dim() >= 1})
    masters = fp16_masters(engine)
    entries = {}
    for name, p in params.items():
        shape = engine.model_index[name][0]
        for key in keys:
            pieces = checkpoint_pieces(engine, name, p, shape, key)
            entries[f"optim.{name}.{key}"] = Entry(shape, torch.float32, pieces, "optim", name, key)
        if masters is not None:
            hit = masters.get(id(p))
            flat = None if hit is None else hit[1]
        elif _zero(engine) == 3:
            group_idx = engine.ds.optimizer.grad_position[engine.ds.optimizer.get_param_id(p)][0]
            flat = engine.ds.optimizer.fp32_partitioned_groups_flat[group_idx]
        else:
            m = getattr(p, "_hp_mapping", None)
            flat = None if m is None else base.param_groups[m.param_group_index]["params"][0]
        step = base.state.get(flat, {}).get("step") if flat is not None else None
        if torch.is_tensor(step):
            entries[f"optim.{name}.step"] = Entry((), step.dtype, [Piece((), step)], "optim", name, "step")
    return entries, []


def clear_optimizer_state(engine) -> None:
    """Every Adam state dropped (the next step starts them as a fresh optimizer does): loading a checkpoint saved
    before any optimizer step."""
    opt = local_optimizer(engine)
    (opt if opt is not None else _base(engine)).state.clear()


def check_checkpointable(engine) -> None:
    """Refuse what this format cannot hold rather than resume wrong: fp16 at ZeRO-0 under an optimizer wrapper
    other than DeepSpeed's FP16_Optimizer / FP16_UnfusedOptimizer (their fp32 masters are held, :func:`fp16_masters`;
    another's would be missed and a resume would restart from the fp16 copies, exit 0). fp16 at ZeRO 1-3 is held
    as bf16 is, the fp32 partitions; the loss scaler through :class:`LossScale` at every stage."""
    if engine.recipe.precision != "fp16" or _zero(engine) != 0 or fp16_masters(engine) is not None:
        return
    opt = getattr(engine.ds, "optimizer", None)
    if opt is None or local_optimizer(engine) is not None:
        return
    from ...checkpoint.dcp_io import CheckpointError

    raise CheckpointError(f"the DeepSpeed back end cannot checkpoint fp16 training at ZeRO-0 under "
                          f"{type(opt).__module__}.{type(opt).__qualname__} (only FP16_Optimizer's and "
                          "FP16_UnfusedOptimizer's fp32 master weights are read) -> use ZeRO stage 1, 2 or 3 "
                          '("zero": {"stage": 1}), "precision": "bf16", or the native back end')


class LossScale:
    """DeepSpeed's fp16 loss scaler as the manifest's JSON: its moving parts (the scale, the iteration counters, the
    hysteresis left; the window, factor and bounds come from the recipe) and the steps DeepSpeed skipped on
    overflow, which its LR scheduler did not count. Without it a resumed run starts again from the initial scale and
    overflows, skipping steps the uninterrupted run took (exit 0). ZeRO 1-3 keep a ``loss_scaler``
    (DynamicLossScaler: ``dynamic``, with hysteresis); ZeRO-0's FP16_Optimizer / FP16_UnfusedOptimizer keep the same
    counters in their ``loss_scale_config`` (``dynamic_loss_scale``, no hysteresis: their ``_update_scale`` halves at
    every overflow); ``last_overflow_iter`` is None there under a static scale and is then not written."""

    KEYS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")

    def __init__(self, engine):
        self.engine = engine

    def _scaler(self):
        return _scaler_of(self.engine.ds.optimizer)

    def state_dict(self) -> dict:
        s = self._scaler()
        out = {k: (float(v) if k == "cur_scale" else int(v)) for k in self.KEYS
               if (v := getattr(s, k, None)) is not None}
        dynamic = getattr(s, "dynamic", getattr(s, "dynamic_loss_scale", False))
        return {**out, "dynamic": bool(dynamic),
                "skipped_steps": int(self.engine.ds.skipped_steps)}

    def load_state_dict(self, state: dict) -> None:
        s = self._scaler()
        for k in self.KEYS:
            if k in state and hasattr(s, k):
                setattr(s, k, state[k])
        ds = self.engine.ds
        ds.skipped_steps = int(state.get("skipped_steps", 0))
        applied = self.engine.step_count - ds.skipped_steps
        if ds.lr_scheduler is not None:  # it stepped on applied steps only (after_load assumed all were)
            ds.lr_scheduler.step(applied - 1)


def _scaler_of(opt):
    """The object holding DeepSpeed's loss-scale counters: ZeRO's ``loss_scaler``, else the fp16 optimizers'
    ``loss_scale_config`` (ZeRO-0), else None."""
    return getattr(opt, "loss_scaler", None) or getattr(opt, "loss_scale_config", None)


def loss_scale(engine):
    """:class:`LossScale` of an fp16 engine (ZeRO 0-3), else None."""
    if engine.recipe.precision == "fp16" and _scaler_of(getattr(engine.ds, "optimizer", None)) is not None:
        return LossScale(engine)
    return None


def before_load(engine):
    if _zero(engine) == 3:
        engine.ds.optimizer.checkpoint_event_prologue()


def after_load(engine, manifest):
    z = _zero(engine)
    if z == 3:
        from deepspeed.utils import safe_get_local_fp32_param

        for p in engine.ds.module.parameters():
            p.ds_tensor.data.copy_(safe_get_local_fp32_param(p).view(-1)[: p.ds_tensor.numel()])
        engine.ds.optimizer.checkpoint_event_epilogue()
    elif (masters := fp16_masters(engine)) is not None:
        # ZeRO-0 fp16: the fp16 parameters as DeepSpeed's step leaves them, copies of the loaded fp32 masters
        with torch.no_grad():
            for p, _, _ in masters.values():
                p.data.copy_(_master_of(engine, masters, p, None))
    elif hasattr(engine.ds.optimizer, "update_lp_params"):
        engine.ds.optimizer.update_lp_params()
    step = int(manifest["step"])
    if engine.ds.lr_scheduler is not None:  # a raw deepspeed block's scheduler: its position is the step count
        # DeepSpeed's schedulers set the optimizer's lr in step(), not in load_state_dict(): step(n - 1) puts both
        # where n optimizer steps leave them (the lr of step n + 1), whoever wrote the checkpoint
        engine.ds.lr_scheduler.step(step - 1)
    engine.ds.global_steps = step
    engine.ds.global_samples = step * engine.layout.global_batch
    engine.ds.micro_steps = step * engine.layout.grad_accum
