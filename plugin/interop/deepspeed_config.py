"""Recipe <-> DeepSpeed config. Pure: no deepspeed import.

:func:`to_ds_config` writes every key a recipe decides (the batch triple, zero_optimization, bf16/fp16,
gradient_clipping, optimizer, pipeline) and then merges the recipe's raw ``deepspeed`` block, which may add keys but
never contradict the recipe, defaults included (:func:`plugin.recipe.deepspeed_block.check_deepspeed_block` reports that
as an error; :mod:`plugin.recipe.deepspeed_block` says which keys the recipe owns). :func:`from_ds_config` is the
inverse: keys with no recipe meaning go under ``deepspeed``, so that ``to_ds_config(from_ds_config(c))`` gives back an
equivalent config (the same keys and values, up to how DeepSpeed reads an optimizer type).
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from ..recipe.deepspeed_block import ACTIVATION_PARTITION_KEYS, activations_split_over_tensor, ds_optimizer
from ..recipe.spec import thaw
from .deepspeed_scheduler import from_ds_scheduler, to_ds_scheduler

# deepspeed.runtime.constants.GRADIENT_CLIPPING_DEFAULT (tests pin it against the installed DeepSpeed).
DEEPSPEED_DEFAULT_GRADIENT_CLIPPING = 1.0

def _offload(device: str, nvme_path: str | None) -> dict:
    out = {"device": device, "pin_memory": True}
    if device == "nvme":
        out["nvme_path"] = nvme_path
    return out


def bf16_sums_in_fp32(stage: int) -> dict:
    """The keys that make DeepSpeed's bf16 sum gradients in fp32, as the native back end does (DeepSpeed 0.19.8
    otherwise sums both in bf16: ``communication_data_type`` defaults to the model's dtype, and
    ``data_types.grad_accum_dtype`` too). From ZeRO-1 on, fp32 accumulation (at ZeRO-1 DeepSpeed's BF16_Optimizer,
    at ZeRO-2/3 the ZeRO optimizer's fp32 gradient partitions); at ZeRO-0 DeepSpeed refuses it ("unsupported mix"),
    and only its pipeline engine accumulates in fp32 there (BF16_Optimizer):
    :func:`plugin.recipe.checks.check_deepspeed_back_end` refuses ZeRO-0 bf16 without a pipeline wherever gradients
    are summed."""
    out: dict[str, Any] = {"communication_data_type": "fp32"}
    if stage >= 1:
        out["data_types"] = {"grad_accum_dtype": "fp32"}
    return out


def recipe_ds_config(recipe, layout) -> dict:
    """The keys the recipe itself decides, before the raw ``deepspeed`` block is merged."""
    z = recipe.zero
    zero: dict[str, Any] = {"stage": z.stage}
    if z.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(z.offload_optimizer, z.nvme_path)
    if z.offload_param != "none":
        zero["offload_param"] = _offload(z.offload_param, z.nvme_path)
    if z.stage == 3 and layout.context > 1:
        # the stage-3 optimizer's one path that divides every bucket's data x context sum by data x context (with it
        # off, DeepSpeed 0.19.8 divides a bucket under reduce_bucket_size by data alone: zero/stage3.py), which the
        # engine's loss scale counts on (plugin/engines/deepspeed/engine.py, sum_scale)
        zero["reduce_scatter"] = True
    cfg: dict[str, Any] = {
        "train_batch_size": layout.global_batch,
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": layout.grad_accum,
        "gradient_clipping": float(recipe.gradient_clipping),
        "zero_optimization": zero,
        "bf16": {"enabled": recipe.precision == "bf16"},
        "fp16": {"enabled": recipe.precision == "fp16"},
    }
    if recipe.precision == "fp16":
        scale = recipe.fp16_resolved
        cfg["fp16"].update({"loss_scale": scale.loss_scale, "initial_scale_power": scale.initial_scale_power,
                            "loss_scale_window": scale.loss_scale_window, "hysteresis": scale.hysteresis,
                            "min_loss_scale": scale.min_loss_scale})
    if recipe.precision == "bf16":  # gradients summed in fp32, over micro-batches and over data ranks
        cfg.update(bf16_sums_in_fp32(z.stage))
    cfg["optimizer"] = ds_optimizer(recipe.optimizer)
    scheduler = to_ds_scheduler(recipe)  # DeepSpeed's nearest to the recipe's lr_schedule (deepspeed_scheduler.py)
    if scheduler is not None:
        cfg["scheduler"] = scheduler
    if layout.context > 1:
        # DeepSpeed's sequence-parallel degree: its engine sums gradients over it and counts data ranks only in the
        # batch triple; it reads the key itself only without an mpu (the plugin's engine hands it one)
        cfg["sequence_parallel_size"] = layout.context
    if layout.expert > 1:
        # DeepSpeed 0.19's AutoEP section: the experts over autoep_size ranks carved out of the data ranks, as the
        # recipe's expert axis; AutoEP finds the MoE layers of the transformers families its presets cover
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": layout.expert,
                                  "expert_tensor_parallel_size": layout.expert_tensor_resolved}
    if recipe.optimizer.name == "sgd" and z.stage >= 1:
        cfg["zero_allow_untested_optimizer"] = True  # DeepSpeed asserts on torch.optim.SGD under ZeRO without it
    if layout.pipeline > 1:
        pp = recipe.pipeline_parallel
        interval = recipe.activation_checkpointing.interval  # full: spans of `every` layers; else 0 (off)
        cfg["pipeline"] = {"stages": layout.pipeline, "partition": pp.partition,
                           "activation_checkpoint_interval": interval}
        if activations_split_over_tensor(recipe):
            cfg["pipeline"].update({key: False for key in ACTIVATION_PARTITION_KEYS})
        if interval > 0:
            # DeepSpeed's reentrant default fails on token ids (recipe/deepspeed_block.py says how)
            cfg["pipeline"]["use_reentrant"] = False
    return cfg


def merge(base: dict, extra: Mapping) -> dict:
    """``extra`` merged into a copy of ``base``: nested dicts merged key by key, other values replaced."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = thaw(value)
    return out


def to_ds_config(recipe, world_size: int | None = None) -> dict:
    """The complete ds_config for ``recipe`` at ``world_size``; DeepSpeed accepts it verbatim."""
    layout = recipe.layout(world_size)
    return merge(recipe_ds_config(recipe, layout), recipe.deepspeed or {})


def _pop(d: dict, *path: str, default=None):
    """Remove and return ``d[path[0]][path[1]]...``; drop dicts left empty."""
    node = d
    for key in path[:-1]:
        node = node.get(key)
        if not isinstance(node, dict):
            return default
    value = node.pop(path[-1], default)
    if len(path) > 1 and not node:
        _pop(d, *path[:-1])
    return value


def _given(v) -> bool:
    return v is not None and v != "auto"


def from_ds_config(cfg: Mapping, world_size: int | None = None, name: str = "imported") -> dict:
    """A recipe (as JSON data) from a DeepSpeed config. Keys with no recipe meaning go under ``deepspeed``.

    The data degree is ``world_size / (pipeline x context)`` when ``world_size`` is given, else derived from a
    complete batch triple, else ``"auto"``. Values of ``"auto"`` (Hugging Face style) are treated as not given.
    ``sequence_parallel_size`` C > 1 (DeepSpeed's Ulysses degree) becomes ``"context": C`` with the
    ``"all_to_all"`` method, Ulysses's. AutoEP's ``expert_parallel`` section, enabled with ``autoep_size`` E > 1,
    becomes ``"expert": E`` (its other keys kept raw) and ``"launcher": "auto"``: the plugin trains an expert axis on
    its native back end.
    """
    rest = copy.deepcopy(thaw(cfg))
    recipe: dict[str, Any] = {"$schema": "../schemas/recipe.schema.json", "name": name,
                              "description": "Imported from a DeepSpeed config."}
    stages = _pop(rest, "pipeline", "stages")
    pipeline = stages if isinstance(stages, int) and not isinstance(stages, bool) and stages >= 1 else 1
    sp = _pop(rest, "sequence_parallel_size")
    context = sp if isinstance(sp, int) and not isinstance(sp, bool) and sp >= 1 else 1
    if sp is not None and context != sp:  # a float or the like: no recipe equivalent; the checks say so
        rest["sequence_parallel_size"] = sp
    g = _pop(rest, "train_batch_size")
    m = _pop(rest, "train_micro_batch_size_per_gpu")
    a = _pop(rest, "gradient_accumulation_steps")
    if world_size is not None:
        data: Any = max(1, world_size // (pipeline * context))
    elif _given(g) and _given(m) and _given(a) and g % (m * a) == 0:
        data = g // (m * a)
    else:
        data = "auto"
    recipe["parallelism"] = {"data": data, "tensor": 1, "pipeline": pipeline, **({"context": context} if context > 1
                                                                                 else {})}
    if context > 1:
        recipe["context_parallel"] = {"method": "all_to_all"}
    expert = _import_expert(rest)
    if expert > 1:
        recipe["parallelism"]["expert"] = expert
    zero: dict[str, Any] = {}
    stage = _pop(rest, "zero_optimization", "stage")
    if stage is not None:
        zero["stage"] = stage
    for kind in ("optimizer", "param"):
        device = _pop(rest, "zero_optimization", f"offload_{kind}", "device")
        path = _pop(rest, "zero_optimization", f"offload_{kind}", "nvme_path")
        pin = _pop(rest, "zero_optimization", f"offload_{kind}", "pin_memory")
        if pin is False:  # the recipe always pins; keep the user's choice as a raw key
            rest.setdefault("zero_optimization", {}).setdefault(f"offload_{kind}", {})["pin_memory"] = False
        if device not in (None, "none"):
            zero[f"offload_{kind}"] = device
        if path:
            zero["nvme_path"] = path
    if zero:
        recipe["zero"] = zero
    pp: dict[str, Any] = {}
    partition = _pop(rest, "pipeline", "partition")
    if partition in ("parameters", "uniform") or (isinstance(partition, str) and partition.startswith("type:")):
        pp["partition"] = partition
    elif partition is not None:  # "profile" and the like: no recipe equivalent; the checks report it
        rest.setdefault("pipeline", {})["partition"] = partition
    interval = _pop(rest, "pipeline", "activation_checkpoint_interval")
    kept = {}  # pipeline keys the recipe reads but a one-stage export writes no section for
    if isinstance(interval, int) and not isinstance(interval, bool) and interval > 0:
        recipe["activation_checkpointing"] = {"mode": "full", "every": interval}
        kept["activation_checkpoint_interval"] = interval
    elif interval == 0 and not isinstance(interval, bool):
        kept["activation_checkpoint_interval"] = 0
    elif interval is not None:  # no recipe equivalent (a float, negative): kept raw; the checks report it
        rest.setdefault("pipeline", {})["activation_checkpoint_interval"] = interval
    if pp:
        recipe["pipeline_parallel"] = pp
    if pipeline == 1 and (pp or kept or stages == 1):  # the recipe exports no section for one stage: keep theirs
        rest.setdefault("pipeline", {}).update({**({"stages": 1} if stages == 1 else {}), **pp, **kept})
    elif _given(stages) and stages != pipeline:  # a float or the like: no recipe equivalent; the checks say so
        rest.setdefault("pipeline", {})["stages"] = stages
    recipe["batch"] = {k: v for k, v in (("global", g), ("micro", m), ("grad_accum", a)) if _given(v)} \
        or {"micro": 1}
    bf16 = _pop(rest, "bf16", "enabled", default=False)
    fp16 = _pop(rest, "fp16", "enabled", default=False)
    bf16, fp16 = (bool(v) if _given(v) else False for v in (bf16, fp16))  # "auto" (Hugging Face): not given
    recipe["precision"] = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    if fp16:
        scale = {k: _pop(rest, "fp16", k) for k in ("loss_scale", "initial_scale_power", "loss_scale_window",
                                                     "hysteresis", "min_loss_scale")}
        scale = {k: v for k, v in scale.items() if v is not None}
        if scale:
            recipe["fp16"] = scale
    for k in ("bf16", "fp16"):  # drop {"enabled": false} leftovers; keep other raw keys
        if rest.get(k) == {}:
            rest.pop(k)
    _import_optimizer(rest, recipe)
    _import_scheduler(rest, recipe)
    clip = _pop(rest, "gradient_clipping")
    # A config without the key clips at DeepSpeed's own default; the recipe says so explicitly.
    recipe["gradient_clipping"] = clip if _given(clip) else DEEPSPEED_DEFAULT_GRADIENT_CLIPPING
    recipe["launcher"] = "auto" if expert > 1 else "deepspeed"
    if rest:
        recipe["deepspeed"] = rest
    return recipe


def _import_expert(rest: dict) -> int:
    """AutoEP's degree when its section is enabled with an integer ``autoep_size`` (1 otherwise); the section's other
    keys stay raw, and an expert tensor degree other than 1 (the recipe's at tensor 1) too."""
    section = rest.get("expert_parallel")
    if not isinstance(section, dict):
        return 1
    size = section.get("autoep_size", 1)
    if section.get("enabled") is not True or not isinstance(size, int) or isinstance(size, bool) or size < 2:
        return 1
    section.pop("enabled"), section.pop("autoep_size")
    if section.get("expert_tensor_parallel_size", 1) == 1:
        section.pop("expert_tensor_parallel_size", None)
    if not section:
        rest.pop("expert_parallel")
    return size


def _import_optimizer(rest: dict, recipe: dict) -> None:
    """Move an Adam / AdamW / SGD section of ``rest`` into ``recipe["optimizer"]``, as DeepSpeed reads it
    (:func:`plugin.recipe.deepspeed_block.optimizer_meaning`, DeepSpeed's defaults filled in). Params with no recipe
    field (``torch_adam``, ``nesterov``...) stay under ``deepspeed.optimizer.params``; an optimizer the recipe cannot
    say stays raw, where the checks report it. ``"auto"`` values (Hugging Face) take DeepSpeed's defaults."""
    from ..recipe.deepspeed_block import optimizer_meaning

    section = rest.get("optimizer")
    if not isinstance(section, dict):
        return
    params = section.get("params") if isinstance(section.get("params"), dict) else {}
    given = {k: v for k, v in params.items() if _given(v)}
    meaning, foreign = optimizer_meaning({**section, "params": given})
    if meaning is None or foreign or set(section) - {"type", "params"}:
        return
    recipe["optimizer"] = meaning
    extra = {k: v for k, v in params.items() if k not in meaning and k != "adam_w_mode"}
    if extra:
        rest["optimizer"] = {"params": extra}
    else:
        rest.pop("optimizer")
    if meaning["name"] == "sgd" and rest.get("zero_allow_untested_optimizer") is True \
            and (recipe.get("zero") or {}).get("stage", 0) >= 1:
        rest.pop("zero_allow_untested_optimizer")  # the recipe writes it for SGD under ZeRO


def _import_scheduler(rest: dict, recipe: dict) -> None:
    """Move a WarmupLR / WarmupDecayLR / WarmupCosineLR block with a linear warmup into ``recipe["lr_schedule"]``
    (:func:`.deepspeed_scheduler.from_ds_scheduler`; its peak becomes the optimizer's lr); any other stays raw."""
    section = rest.get("scheduler")
    if section is None:
        return
    lr = (recipe.get("optimizer") or {}).get("lr", 1e-3)
    schedule, peak = from_ds_scheduler(section, lr)
    if schedule is None:
        return
    recipe["lr_schedule"] = schedule
    if peak is not None and peak != lr:
        recipe.setdefault("optimizer", {})["lr"] = peak
    rest.pop("scheduler")
