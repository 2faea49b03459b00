"""From an engine's parameters and optimizer to a :class:`~.boxes.LocalState`, and the save/load every back end
shares: the model index (canonical names, global shapes) and the TP layouts recorded by ``initialize``, the RNG
streams (restored only into the same layout), step, loss scaler and client_state (JSON) in the manifest.

A back end gives: ``named_local_params()`` (canonical name -> the parameter this rank holds: plain, or an FSDP2
DTensor), ``local_optimizer()`` (the torch optimizer stepping this rank's parameters), and optionally its own
``checkpoint_pieces(name, tensor, global_shape)`` (DeepSpeed's flat partitions).
"""
from __future__ import annotations

import dataclasses

import torch

from ..errors import Problem
from ..tensor_parallel.random import tensor_parallel_rngs
from .boxes import Entry, LocalState, Piece, TensorLayout, compose, dtensor_held, tp_segments, whole_held
from .dcp_io import CheckpointError
from .manifest import model_problems, recipe_problems
from .store import load as store_load
from .store import open_checkpoint
from .store import save as store_save


def model_index(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{canonical name: (global shape, dtype)}`` of the unsharded model (tied aliases once, first name)."""
    return {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """``{alias: canonical name}`` of parameters reachable under several names (tied weights)."""
    first: dict[int, str] = {}
    out = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[n] = first[id(p)]
        else:
            first[id(p)] = n
    return out


def hf_configs(model: torch.nn.Module) -> dict:
    """A transformers model's ``config.json`` and ``generation_config.json`` as JSON (what ``save_pretrained``
    writes), for the export to write beside the weights; ``{}`` for any other model."""
    import json

    out = {}
    for key, attr in (("hf_config", "config"), ("hf_generation_config", "generation_config")):
        config = getattr(model, attr, None)
        if callable(getattr(config, "to_json_string", None)) and callable(getattr(config, "to_dict", None)):
            out[key] = json.loads(config.to_json_string(use_diff=attr == "generation_config"))
    if "hf_config" in out and not out["hf_config"].get("architectures"):
        out["hf_config"]["architectures"] = [type(model).__name__]  # as save_pretrained writes it
    return out


def recording_tp(apply_tp):
    """``apply_tp`` that also records ``{name: TensorLayout}`` of the parameters it sharded (returned dict)."""
    from .boxes import layout_of

    layouts: dict[str, TensorLayout] = {}

    def apply(model, *args, **kwargs):
        out = apply_tp(model, *args, **kwargs)
        layouts.update({n: layout_of(p) for n, p in (out if out is not None else model).named_parameters()})
        return out

    return apply, layouts


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor" or hasattr(t, "_local_tensor")


def pieces_of(t: torch.Tensor, global_shape, layout: TensorLayout, tp_rank: int, tp_size: int) -> list[Piece]:
    held = dtensor_held(t) if _is_dtensor(t) else whole_held(t.detach())
    return compose(held, tp_segments(tuple(t.shape), global_shape, layout, tp_rank, tp_size))


def param_boxes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """``{parameter name: its offsets in the whole tensor}`` for the parameters that hold one box of a larger tensor
    (an expert rank's experts), from each module's ``param_boxes`` (on the module: materialising and FSDP2 replace
    the parameter objects, not the module)."""
    out = {}
    for mname, m in model.named_modules():
        for pname, offsets in (getattr(m, "param_boxes", None) or {}).items():
            out[f"{mname}.{pname}" if mname else pname] = tuple(offsets)
    return out


def boxed_pieces(t: torch.Tensor, boxed) -> list[Piece]:
    """An expert rank's box of a whole tensor (``boxed``: its offsets there), held whole or as an FSDP2 shard."""
    held = dtensor_held(t) if _is_dtensor(t) else whole_held(t.detach())
    return [Piece(tuple(b + o for b, o in zip(boxed, off, strict=True)), view) for off, view in held]


def same_layout_key(engine) -> str:
    d = engine.describe()
    return (f"{engine.backend}-w{engine.topology.world_size if hasattr(engine.topology, 'world_size') else '?'}"
            f"-pp{d['pipeline']}-tp{d['tensor']}-dp{d['data']}-mb{d['micro_batch']}-ga{d['grad_accum']}"
            f"-v{getattr(engine, 'virtual_stages', 1)}" + (f"-cp{d['context']}" if d.get("context", 1) > 1 else ""))


def materialise_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """A fresh optimizer has no state: one step at lr 0 on zero gradients creates it (no parameter moves)."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p not in optimizer.state or
              not optimizer.state[p]]
    if not params:
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    saved = {p: p.grad for g in optimizer.param_groups for p in g["params"]}
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr
    for p, grad in saved.items():
        p.grad = grad


def local_state(engine, *, for_load: bool, manifest: dict | None = None) -> LocalState:
    index, layouts = engine.model_index, engine.tp_layouts
    tp_rank, tp_size = engine.groups.tp_rank, engine.layout.tensor
    custom = getattr(engine, "checkpoint_pieces", None)
    entries: dict[str, Entry] = {}
    after: list = []
    params = engine.named_local_params()
    boxes = param_boxes(engine.whole_model)
    for name, p in params.items():
        shape, dtype = index[name]
        boxed = boxes.get(name)  # one box of the global tensor (an expert rank's experts)
        pieces = boxed_pieces(p, boxed) if boxed is not None else custom(name, p, shape, None) if custom \
            else pieces_of(p, shape, layouts.get(name, TensorLayout()), tp_rank, tp_size)
        entries[name] = Entry(shape, dtype if custom is None else torch.float32, pieces)
    # a checkpoint saved before the optimizer ever stepped (fp16 whose first steps all overflowed) holds no states:
    # the loading optimizer then starts fresh too, rather than keep its own or a materialised step count
    fresh = for_load and manifest is not None and not any(t["role"] == "optim" for t in manifest["tensors"].values())
    if fresh:
        clear = getattr(engine, "clear_optimizer_state", None)
        if clear is not None:
            clear()
        elif engine.local_optimizer() is not None:
            engine.local_optimizer().state.clear()
    optimizer = None if fresh else engine.local_optimizer()
    if optimizer is not None:
        if for_load:
            materialise_optimizer_state(optimizer)
        by_id = {id(p): n for n, p in params.items()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = by_id.get(id(p))
                if name is None:
                    continue
                shape = index[name][0]
                for key, v in optimizer.state.get(p, {}).items():
                    if not torch.is_tensor(v):
                        continue
                    full = f"optim.{name}.{key}"
                    if v.dim() == 0:
                        local = v.to_local() if _is_dtensor(v) else v
                        entries[full] = Entry((), v.dtype, [Piece((), local)], "optim", name, key)
                    else:
                        boxed = boxes.get(name)
                        pieces = boxed_pieces(v, boxed) if boxed is not None else custom(name, v, shape, key) \
                            if custom else pieces_of(v, shape, layouts.get(name, TensorLayout()), tp_rank, tp_size)
                        entries[full] = Entry(shape, v.dtype, pieces, "optim", name, key)
    extra = None if fresh else getattr(engine, "checkpoint_extra", None)
    if extra is not None:
        more, more_after = extra(params, for_load)
        entries.update(more)
        after += more_after
    rank = engine.rank
    rngs = tensor_parallel_rngs(engine.module)
    if not for_load:
        streams = {"torch": torch.get_rng_state()}
        for j, r in enumerate(rngs):
            for dev, st in r.state_dict().items():
                streams[f"tp{j}.{dev}"] = st
        for k, st in streams.items():
            entries[f"rng/{rank}/{k}"] = Entry(tuple(st.shape), st.dtype, [Piece((0,) * st.dim(), st)], "rng")
    elif manifest is not None and (manifest.get("rng") or {}).get("same_layout_key") == same_layout_key(engine):
        prefix = f"rng/{rank}/"
        bufs = {}
        for name, rec in manifest["tensors"].items():
            if name.startswith(prefix):
                buf = torch.empty(rec["shape"], dtype=getattr(torch, rec["dtype"]))
                bufs[name[len(prefix):]] = buf
                entries[name] = Entry(tuple(rec["shape"]), buf.dtype, [Piece((0,) * buf.dim(), buf)], "rng")

        def restore_rng():
            if "torch" in bufs:
                torch.set_rng_state(bufs["torch"])
            per = {}
            for k, buf in bufs.items():
                if k.startswith("tp"):
                    j, dev = k[2:].split(".", 1)
                    per.setdefault(int(j), {})[dev] = buf
            for j, r in enumerate(rngs):
                r.load_state_dict(per.get(j, {}))

        after.append(restore_rng)
    return LocalState(entries, after)


def save(engine, directory: str, client_state: dict | None = None, *, keep: int | None = None):
    state = local_state(engine, for_load=False)
    scaler = getattr(engine, "scaler", None)
    schedule = getattr(engine, "lr_schedule", None)  # the recipe's lr_schedule: its position (the step count)
    state.scalars = {"step": engine.step_count, "client_state": dict(client_state or {}),
                     "scaler": scaler.state_dict() if scaler is not None and hasattr(scaler, "state_dict") else None,
                     "lr_schedule": schedule.state_dict() if schedule is not None else None}
    recipe = engine.recipe
    info = {"written_by": {"backend": engine.backend, "torch": torch.__version__},
            "layout": {**engine.describe(), "virtual_stages": getattr(engine, "virtual_stages", 1)},
            "recipe": {"name": recipe.name, "model": dataclasses.asdict(recipe.model) if recipe.model else None},
            "optimizer": {"name": recipe.optimizer.name},
            "model": {"class": f"{type(engine.whole_model).__module__}.{type(engine.whole_model).__qualname__}",
                      "tied": tied_aliases(engine.whole_model), **hf_configs(engine.whole_model)},
            "rng": {"same_layout_key": same_layout_key(engine)}}
    return store_save(state, directory, engine.step_count, info, keep=keep)


def load(engine, directory: str) -> dict:
    step_dir, manifest = open_checkpoint(directory)
    problems = model_problems(manifest, {n: s for n, (s, _) in engine.model_index.items()})
    problems += recipe_problems(manifest, engine.recipe, engine.layout.global_batch)
    errors = [p for p in problems if p.is_error]
    if errors:
        raise CheckpointError(f"{step_dir}: this run cannot load the checkpoint:\n  "
                              + "\n  ".join(p.format() for p in errors))
    state = local_state(engine, for_load=True, manifest=manifest)
    if getattr(engine, "before_load", None):
        engine.before_load()
    store_load(state, step_dir, manifest)
    optimizer = engine.local_optimizer()
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    if getattr(engine, "after_load", None):
        engine.after_load(manifest)
    engine.step_count = int(manifest["step"])  # before the scaler, which may need it (DeepSpeed's skipped steps)
    scalars = manifest.get("scalars", {})
    scaler = getattr(engine, "scaler", None)
    # DeepSpeed's loss scaler and torch's GradScaler (native, Accelerate) keep different states: across them the
    # scaler starts again from the recipe's initial scale
    same_kind = ((manifest.get("written_by") or {}).get("backend") == "deepspeed") == (engine.backend == "deepspeed")
    if scaler is not None and scalars.get("scaler") and same_kind and hasattr(scaler, "load_state_dict"):
        scaler.load_state_dict(scalars["scaler"])
    schedule = getattr(engine, "lr_schedule", None)
    if schedule is not None:  # a checkpoint written without a schedule resumes it at its step
        schedule.load_state_dict(scalars.get("lr_schedule") or {"position": engine.step_count})
    return {"step": engine.step_count, **scalars.get("client_state", {})}


__all__ = ["Problem", "load", "local_state", "model_index", "save"]
