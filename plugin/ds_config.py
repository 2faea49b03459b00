"""Recipe <-> DeepSpeed config, and recipe -> Accelerate config YAML. Pure: no deepspeed import.

:func:`to_ds_config` writes every key a recipe decides (the batch triple, zero_optimization, bf16/fp16,
gradient_clipping, optimizer, pipeline) and then merges the recipe's raw ``deepspeed`` block, which may
add keys but never contradict the recipe (:func:`deepspeed_block_problems` reports that as an error).
:func:`from_ds_config` is the inverse: keys with no recipe meaning go under ``deepspeed``, so that
``to_ds_config(from_ds_config(c))`` gives back an equivalent config.
"""
from __future__ import annotations

import copy
from typing import Any, Iterator, Mapping, Optional

from .errors import Problem
from .recipe import _thaw

# deepspeed.runtime.constants.GRADIENT_CLIPPING_DEFAULT (tests pin it against the installed DeepSpeed).
DEEPSPEED_DEFAULT_GRADIENT_CLIPPING = 1.0

# DeepSpeed's optimizer type per recipe optimizer; sgd has none (the engine passes torch.optim.SGD).
_DS_OPTIMIZER = {"adamw": "AdamW", "adam": "Adam"}


def _offload(device: str, nvme_path: Optional[str]) -> dict:
    out = {"device": device, "pin_memory": True}
    if device == "nvme":
        out["nvme_path"] = nvme_path
    return out


def recipe_ds_config(recipe, layout) -> dict:
    """The keys the recipe itself decides, before the raw ``deepspeed`` block is merged."""
    z = recipe.zero
    zero: dict[str, Any] = {"stage": z.stage}
    if z.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(z.offload_optimizer, z.nvme_path)
    if z.offload_param != "none":
        zero["offload_param"] = _offload(z.offload_param, z.nvme_path)
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
        from .recipe import LossScale

        scale = recipe.fp16 or LossScale()
        cfg["fp16"].update({"loss_scale": scale.loss_scale, "initial_scale_power": scale.initial_scale_power,
                            "loss_scale_window": scale.loss_scale_window, "hysteresis": scale.hysteresis,
                            "min_loss_scale": scale.min_loss_scale})
    opt = recipe.optimizer
    if opt.name in _DS_OPTIMIZER:
        params = {"lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay}
        if opt.name == "adam":
            params["adam_w_mode"] = False  # DeepSpeed's "Adam" is AdamW unless told otherwise
        cfg["optimizer"] = {"type": _DS_OPTIMIZER[opt.name], "params": params}
    if layout.pipeline > 1:
        pp = recipe.pipeline_parallel
        cfg["pipeline"] = {"stages": layout.pipeline, "partition": pp.partition,
                           "activation_checkpoint_interval": pp.activation_checkpoint_interval}
    return cfg


def merge(base: dict, extra: Mapping) -> dict:
    """``extra`` merged into a copy of ``base``: nested dicts merged key by key, other values replaced."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = _thaw(value)
    return out


def _conflicts(ours: Mapping, theirs: Mapping, path: str) -> Iterator[tuple[str, Any, Any]]:
    for key, value in theirs.items():
        if key not in ours:
            continue
        if isinstance(value, Mapping) and isinstance(ours[key], Mapping):
            yield from _conflicts(ours[key], value, f"{path}.{key}")
        elif _thaw(value) != ours[key] and not (_is_number(value) and _is_number(ours[key])
                                                and float(value) == float(ours[key])):
            yield f"{path}.{key}", value, ours[key]


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# Where each contradicted ds_config key is set in a recipe.
_RECIPE_HOME = {
    "train_batch_size": "$.batch.global", "train_micro_batch_size_per_gpu": "$.batch.micro",
    "gradient_accumulation_steps": "$.batch.grad_accum", "gradient_clipping": "$.gradient_clipping",
    "zero_optimization": "$.zero", "bf16": "$.precision", "fp16": "$.precision (and $.fp16)",
    "optimizer": "$.optimizer", "pipeline": "$.pipeline_parallel",
}


def deepspeed_block_problems(recipe, layout) -> Iterator[Problem]:
    """Errors for keys of the raw ``deepspeed`` block that contradict what the recipe decides."""
    block = recipe.deepspeed or {}
    if "optimizer" in block and recipe.optimizer.name not in _DS_OPTIMIZER:
        yield Problem("$.deepspeed.optimizer", "an optimizer block here would fight the recipe's optimizer",
                      "set it in $.optimizer")
    if layout is None:
        return
    ours = recipe_ds_config(recipe, layout)
    for path, theirs, mine in _conflicts(ours, block, "$.deepspeed"):
        top = path.split(".")[2]
        yield Problem(path, f"{theirs!r} contradicts the recipe, which gives {mine!r}",
                      f"drop it here and set {_RECIPE_HOME.get(top, 'the recipe field')} instead")


def to_ds_config(recipe, world_size: Optional[int] = None) -> dict:
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


def from_ds_config(cfg: Mapping, world_size: Optional[int] = None, name: str = "imported") -> dict:
    """A recipe (as JSON data) from a DeepSpeed config. Keys with no recipe meaning go under ``deepspeed``.

    The data degree is ``world_size / pipeline`` when ``world_size`` is given, else derived from a complete
    batch triple, else ``"auto"``. Values of ``"auto"`` (Hugging Face style) are treated as not given.
    """
    rest = copy.deepcopy(_thaw(cfg))
    recipe: dict[str, Any] = {"$schema": "../schemas/recipe.schema.json", "name": name,
                              "description": "Imported from a DeepSpeed config."}
    pipeline = _pop(rest, "pipeline", "stages")
    pipeline = pipeline if isinstance(pipeline, int) else 1
    g = _pop(rest, "train_batch_size")
    m = _pop(rest, "train_micro_batch_size_per_gpu")
    a = _pop(rest, "gradient_accumulation_steps")
    if world_size is not None:
        data: Any = max(1, world_size // pipeline)
    elif _given(g) and _given(m) and _given(a) and g % (m * a) == 0:
        data = g // (m * a)
    else:
        data = "auto"
    recipe["parallelism"] = {"data": data, "tensor": 1, "pipeline": pipeline}
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
    if pipeline > 1:
        pp: dict[str, Any] = {}
        partition = _pop(rest, "pipeline", "partition")
        if partition in ("parameters", "uniform") or (isinstance(partition, str) and partition.startswith("type:")):
            pp["partition"] = partition
        interval = _pop(rest, "pipeline", "activation_checkpoint_interval")
        if interval is not None:
            pp["activation_checkpoint_interval"] = interval
        if pp:
            recipe["pipeline_parallel"] = pp
    recipe["batch"] = {k: v for k, v in (("global", g), ("micro", m), ("grad_accum", a)) if _given(v)} \
        or {"micro": 1}
    bf16 = bool(_pop(rest, "bf16", "enabled", default=False))
    fp16 = bool(_pop(rest, "fp16", "enabled", default=False))
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
    opt_type = str((rest.get("optimizer") or {}).get("type", "")).lower()
    params = (rest.get("optimizer") or {}).get("params", {})
    adam_w = params.get("adam_w_mode", True)
    if opt_type in ("adam", "adamw") and set(params) <= {"lr", "betas", "eps", "weight_decay", "adam_w_mode"} \
            and all(_given(v) for v in params.values()) and (opt_type == "adamw" or adam_w is False):
        rest.pop("optimizer")
        recipe["optimizer"] = {"name": opt_type, **{k: v for k, v in params.items() if k != "adam_w_mode"}}
    clip = _pop(rest, "gradient_clipping")
    # A config without the key clips at DeepSpeed's own default; the recipe says so explicitly.
    recipe["gradient_clipping"] = clip if _given(clip) else DEEPSPEED_DEFAULT_GRADIENT_CLIPPING
    recipe["launcher"] = "deepspeed"
    if rest:
        recipe["deepspeed"] = rest
    return recipe


def _yaml_scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _yaml(data: Mapping, indent: int = 0) -> list[str]:
    lines = []
    for key, value in data.items():
        if isinstance(value, Mapping):
            lines.append(" " * indent + f"{key}:")
            lines.extend(_yaml(value, indent + 2))
        else:
            lines.append(" " * indent + f"{key}: {_yaml_scalar(value)}")
    return lines


def to_accelerate_config(recipe, world_size: Optional[int] = None, *, cpu: bool = False) -> str:
    """An ``accelerate launch --config_file`` YAML for ``recipe``.

    tensor = pipeline = 1: ZeRO 0 is Accelerate's DDP (MULTI_GPU, or MULTI_CPU with ``cpu``); ZeRO >= 1 is
    its DeepSpeed plugin with the recipe's stage, offload, accumulation and clipping. With tensor or pipeline
    > 1 Accelerate only launches the processes (MULTI_GPU/MULTI_CPU) and train.py runs the plugin's native
    back end, which builds those groups itself.
    """
    layout = recipe.layout(world_size)
    nodes = recipe.cluster.nodes if recipe.cluster else 1
    mixed = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[recipe.precision]
    native_only = layout.tensor > 1 or layout.pipeline > 1
    cfg: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "debug": False}
    if cpu:
        cfg["distributed_type"] = "MULTI_CPU" if layout.world_size > 1 else "NO"
    elif recipe.zero.stage >= 1 and not native_only:
        z = recipe.zero
        ds = {"gradient_accumulation_steps": layout.grad_accum, "gradient_clipping": float(recipe.gradient_clipping),
              "offload_optimizer_device": z.offload_optimizer, "offload_param_device": z.offload_param,
              "zero3_init_flag": z.stage == 3, "zero_stage": z.stage}
        if z.nvme_path:
            ds["offload_optimizer_nvme_path"] = ds["offload_param_nvme_path"] = z.nvme_path
        if nodes > 1:
            ds["deepspeed_multinode_launcher"] = "standard"
        cfg["distributed_type"] = "DEEPSPEED"
        cfg["deepspeed_config"] = ds
    else:
        cfg["distributed_type"] = "MULTI_GPU" if layout.world_size > 1 else "NO"
    cfg.update({"machine_rank": 0, "main_training_function": "main", "mixed_precision": mixed,
                "num_machines": nodes, "num_processes": layout.world_size, "rdzv_backend": "static",
                "same_network": True, "use_cpu": cpu})
    header = [f"# accelerate config for recipe {recipe.name!r} ({layout.world_size} processes)"]
    if native_only:
        header.append("# tensor/pipeline parallelism: accelerate launches, the plugin's native back end trains")
    return "\n".join(header + _yaml(cfg)) + "\n"
