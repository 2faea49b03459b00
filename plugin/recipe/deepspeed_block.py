"""The recipe's raw ``deepspeed`` block: which ds_config keys a recipe decides, and the rule that refuses raw keys
contradicting them (:func:`check_deepspeed_block`, one of :mod:`plugin.recipe.checks`'s rules).

The recipe owns the batch triple, ``gradient_clipping``, ``zero_optimization.stage`` and the offload
devices, the pipeline's stages / partition / checkpoint interval, fp16 / bf16 ``enabled`` and the loss-scale
keys, the optimizer and ``sequence_parallel_size`` (the context degree; at ZeRO-3 with a context axis,
``zero_optimization.reduce_scatter``: true); with activation checkpointing in a pipeline, ``pipeline.use_reentrant``
(false); under sequence parallelism in a tensor x pipeline layout,
``pipeline.pipe_partitioned`` and ``grad_partitioned`` (false: :func:`activations_split_over_tensor`). A raw key
there may only repeat what the recipe says, *including its defaults* (``{"pipeline": {"stages": 4}}`` under a
one-stage recipe is an error, not an override); every other raw key (``overlap_comm``, ``reduce_bucket_size``, a
scheduler, ``torch_adam``...) is merged as given.

The optimizer is compared by what DeepSpeed 0.19 builds from it (``runtime/engine.py``
``_configure_basic_optimizer``): ``"Adam"`` with ``adam_w_mode`` left at its default ``True`` is AdamW,
``"AdamW"`` is AdamW whatever ``adam_w_mode`` says, the type is case-insensitive for DeepSpeed's own
optimizers and ``"SGD"`` is ``torch.optim.SGD`` (looked up by exact name). Pure: no deepspeed import.
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import Problem
from .layout import known_grad_accum
from .spec import thaw

# DeepSpeed's defaults for what an optimizer section leaves out: FusedAdam and DeepSpeedCPUAdam take lr 1e-3,
# betas (0.9, 0.999), eps 1e-8, weight_decay 0; with "torch_adam": true DeepSpeed builds torch.optim.AdamW, whose
# weight_decay default is 0.01; torch.optim.SGD takes lr 1e-3, momentum 0, weight_decay 0.
ADAM_DEFAULTS = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
TORCH_ADAMW_WEIGHT_DECAY = 0.01
SGD_DEFAULTS = {"lr": 1e-3, "momentum": 0.0, "weight_decay": 0.0}
RECIPE_OPTIMIZERS = 'adamw, adam and sgd (DeepSpeed "AdamW", "Adam" with adam_w_mode false, "SGD")'

# DeepSpeed's pipeline engine (runtime/pipe/engine.py) sends each tensor rank 1/tp of a stage's output (and of
# its gradient) and rebuilds the whole from every rank's part; both default to true.
ACTIVATION_PARTITION_KEYS = ("pipe_partitioned", "grad_partitioned")


def activations_split_over_tensor(recipe) -> bool:
    """Whether a stage's output differs between the tensor ranks of a pipeline: under sequence parallelism each
    holds its own slice of the sequence. DeepSpeed's activation partitioning between stages assumes the output
    is replicated over the tensor group and rebuilds a mix of slices otherwise (measured on cpu_tp2_sp_pp2: 0.2 %
    off one process at step 2, 5 % at step 7, exit 0), so the recipe turns it off there."""
    return recipe.tensor_parallel.sequence_parallel and recipe.parallelism.tensor > 1 \
        and recipe.parallelism.pipeline > 1


# DeepSpeed's optimizer type per Adam of the recipe ("SGD" is torch.optim.SGD, looked up by name).
_DS_OPTIMIZER = {"adamw": "AdamW", "adam": "Adam"}


def ds_optimizer(opt) -> dict:
    """The recipe's optimizer as a DeepSpeed optimizer section that builds exactly it (see the module docstring)."""
    if opt.name == "sgd":
        return {"type": "SGD", "params": {"lr": opt.lr, "momentum": opt.momentum, "weight_decay": opt.weight_decay}}
    params = {"lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay}
    if opt.name == "adam":
        params["adam_w_mode"] = False  # DeepSpeed's "Adam" is AdamW unless told otherwise
    return {"type": _DS_OPTIMIZER[opt.name], "params": params}


ABSENT = object()  # an owned key the recipe leaves out on purpose: any raw value contradicts it


@dataclass(frozen=True)
class Owned:
    """One ds_config key the recipe decides: its value (or :data:`ABSENT`), the recipe field that sets it,
    and for ABSENT why the key must not be there."""

    value: Any
    home: str
    why: str = ""


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def same(a, b) -> bool:
    """Equal as DeepSpeed reads them: 1 == 1.0, a tuple equals a list."""
    if _num(a) and _num(b):
        return float(a) == float(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def shown(v) -> str:
    try:
        return json.dumps(v)
    except (TypeError, ValueError):
        return repr(v)


def optimizer_meaning(section: Mapping) -> tuple[dict | None, list[str]]:
    """What DeepSpeed builds from an optimizer section, as the recipe's optimizer fields with DeepSpeed's
    defaults filled in, plus the params it would pass that this optimizer does not take (``momentum`` to an
    Adam, ``betas`` to SGD...). ``(None, [])`` when it is no optimizer the recipe can say."""
    kind = section.get("type")
    params = section.get("params")
    params = params if isinstance(params, Mapping) else {}
    if not isinstance(kind, str):
        return None, []
    if kind.lower() in ("adam", "adamw"):
        adam_w = kind.lower() == "adamw" or params.get("adam_w_mode", True) is not False
        out = {"name": "adamw" if adam_w else "adam", **ADAM_DEFAULTS}
        if params.get("torch_adam") is True and adam_w:
            out["weight_decay"] = TORCH_ADAMW_WEIGHT_DECAY
        foreign = [k for k in ("momentum",) if k in params]
    elif kind == "SGD":
        out = {"name": "sgd", **SGD_DEFAULTS}
        foreign = [k for k in ("betas", "eps", "adam_w_mode") if k in params]
    else:
        return None, []
    out.update({k: params[k] for k in out if k in params and k != "name"})
    return out, foreign


def owned_keys(recipe, layout) -> dict:
    """The ds_config keys ``recipe`` decides, as a tree of :class:`Owned` leaves (the optimizer apart).

    Without a layout (``"auto"`` before the world size is known) the batch keys are those the batch block
    fixes by itself.
    """
    z, b = recipe.zero, recipe.batch
    if layout is not None:
        g, m, a = layout.global_batch, layout.micro_batch, layout.grad_accum
    else:
        g, m, a = b.global_, b.micro, known_grad_accum(b)
    tree: dict[str, Any] = {}
    for key, value, home in (("train_batch_size", g, "$.batch.global"),
                             ("train_micro_batch_size_per_gpu", m, "$.batch.micro"),
                             ("gradient_accumulation_steps", a, "$.batch.grad_accum")):
        if value is not None:
            tree[key] = Owned(value, home)
    tree["gradient_clipping"] = Owned(float(recipe.gradient_clipping), "$.gradient_clipping")
    no_path = Owned(ABSENT, "$.zero.nvme_path", "the recipe sets no zero.nvme_path")
    zero: dict[str, Any] = {"stage": Owned(z.stage, "$.zero.stage")}
    for kind in ("optimizer", "param"):
        home = f"$.zero.offload_{kind}"
        zero[f"offload_{kind}"] = {"device": Owned(getattr(z, f"offload_{kind}"), home),
                                   "nvme_path": Owned(z.nvme_path, "$.zero.nvme_path") if z.nvme_path else no_path}
    for old, new in (("cpu_offload", "optimizer"), ("cpu_offload_param", "param")):
        zero[old] = Owned(ABSENT, f"$.zero.offload_{new}", f"it is DeepSpeed's deprecated alias of offload_{new}")
    if z.stage == 3 and recipe.parallelism.context > 1:  # interop.deepspeed_config.recipe_ds_config says why
        zero["reduce_scatter"] = Owned(True, "$.parallelism.context")
    tree["zero_optimization"] = zero
    scale = recipe.fp16_resolved
    fp16 = {"enabled": Owned(recipe.precision == "fp16", "$.precision")}
    for key in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
        fp16[key] = Owned(getattr(scale, key), f"$.fp16.{key}")
    tree["fp16"] = fp16
    tree["bf16"] = {"enabled": Owned(recipe.precision == "bf16", "$.precision")}
    for other in ("amp", "torch_autocast"):  # other mixed-precision switches would override the recipe's precision
        tree[other] = {"enabled": Owned(False, "$.precision")}
    pp = recipe.pipeline_parallel
    tree["pipeline"] = {
        "stages": Owned(recipe.parallelism.pipeline, "$.parallelism.pipeline"),
        "partition": Owned(pp.partition, "$.pipeline_parallel.partition"),
        "activation_checkpoint_interval": Owned(recipe.activation_checkpointing.interval,
                                                "$.activation_checkpointing"),
    }
    if activations_split_over_tensor(recipe):  # partitioning would rebuild stage outputs from mixed sequence slices
        for key in ACTIVATION_PARTITION_KEYS:
            tree["pipeline"][key] = Owned(False, "$.tensor_parallel.sequence_parallel")
    if recipe.parallelism.pipeline > 1 and recipe.activation_checkpointing.interval > 0:
        # DeepSpeed's reentrant checkpoint (its default) gives a layer range fed integer token ids no gradients:
        # backward fails at the first stage ("element 0 of tensors does not require grad"), measured on 0.19.8
        tree["pipeline"]["use_reentrant"] = Owned(False, "$.activation_checkpointing")
    if recipe.optimizer.name == "sgd" and z.stage >= 1:
        tree["zero_allow_untested_optimizer"] = Owned(True, "$.optimizer.name")
    tree["sequence_parallel_size"] = Owned(recipe.parallelism.context, "$.parallelism.context")
    return tree


def _contradiction(path: str, theirs, owned: Owned) -> Problem:
    if owned.value is ABSENT:
        return Problem(path, f"{shown(theirs)} contradicts the recipe: {owned.why}",
                       f"drop it here and set {owned.home} instead")
    return Problem(path, f"{shown(theirs)} contradicts the recipe's {owned.home}, which gives {shown(owned.value)}",
                   f"drop it here and set {owned.home} instead")


# The recipe fields behind each owned section, for a section given as something other than an object.
_SECTION_HOME = {"zero_optimization": "$.zero", "offload_optimizer": "$.zero.offload_optimizer",
                 "offload_param": "$.zero.offload_param", "fp16": "$.precision and $.fp16", "bf16": "$.precision",
                 "amp": "$.precision", "torch_autocast": "$.precision",
                 "pipeline": "$.parallelism.pipeline and $.pipeline_parallel"}


def owned_problems(owned: Mapping, raw: Mapping, path: str) -> Iterator[Problem]:
    """Raw keys under ``path`` that contradict the owned tree; keys it does not own are left alone."""
    for key, value in raw.items():
        if key not in owned:
            continue
        mine, here = owned[key], f"{path}.{key}"
        if isinstance(mine, Owned):
            if mine.value is ABSENT or not same(value, mine.value):
                yield _contradiction(here, value, mine)
        elif isinstance(value, Mapping):
            yield from owned_problems(mine, value, here)
        else:
            yield Problem(here, f"{shown(value)} is not an object; DeepSpeed reads {key} as one",
                          f"drop it here and set {_SECTION_HOME.get(key, 'the recipe')} instead")


def optimizer_problems(recipe, ours: Mapping | None, raw) -> Iterator[Problem]:
    """The raw block's ``optimizer`` section, merged over the recipe's own (``ours``), must build the
    recipe's optimizer."""
    path = "$.deepspeed.optimizer"
    if not isinstance(raw, Mapping) or not isinstance(raw.get("params", {}), Mapping):
        bad = path if not isinstance(raw, Mapping) else path + ".params"
        yield Problem(bad, "is not an object; DeepSpeed reads it as one", "drop it here and set $.optimizer instead")
        return
    merged = {**(ours or {}), **raw, "params": {**(ours or {}).get("params", {}), **raw.get("params", {})}}
    meaning, foreign = optimizer_meaning(merged)
    opt = recipe.optimizer
    if meaning is None:
        yield Problem(path + ".type", f"{shown(merged.get('type'))} contradicts the recipe's $.optimizer.name, "
                      f'which gives "{opt.name}": the recipe\'s optimizers are {RECIPE_OPTIMIZERS}',
                      "drop it here and set $.optimizer.name instead (any other optimizer: pass it from your "
                      "training script)")
        return
    if meaning["name"] != opt.name:
        key = "type" if "type" in raw or "adam_w_mode" not in raw.get("params", {}) else "params.adam_w_mode"
        value = raw.get("type") if key == "type" else raw["params"]["adam_w_mode"]
        yield Problem(f"{path}.{key}", f"{shown(value)} makes DeepSpeed build {meaning['name']}, but the recipe's "
                      f'$.optimizer.name gives "{opt.name}"', "drop it here and set $.optimizer.name instead")
        return
    for key in foreign:
        yield Problem(f"{path}.params.{key}", f"{shown(raw['params'][key])} contradicts the recipe: its optimizer "
                      f"{opt.name} takes no {key}", f"drop it here (a recipe sets {key} in $.optimizer for "
                      f"{'sgd' if key == 'momentum' else 'adam and adamw'} only)")
    for key in ("lr", "betas", "eps", "weight_decay", "momentum"):
        if key in meaning and key in raw.get("params", {}) and not same(meaning[key], getattr(opt, key)):
            yield Problem(f"{path}.params.{key}", f"{shown(raw['params'][key])} contradicts the recipe's "
                          f"$.optimizer.{key}, which gives {shown(_listed(getattr(opt, key)))}",
                          f"drop it here and set $.optimizer.{key} instead")


def _listed(v):
    return list(v) if isinstance(v, tuple) else v


def check_deepspeed_block(recipe, layout) -> Iterator[Problem]:
    """Errors for keys of the raw ``deepspeed`` block that contradict what the recipe decides, defaults included
    (:func:`owned_keys`, :func:`optimizer_problems`); ``layout`` may be ``None`` ("auto" before the world size is
    known)."""
    if recipe.deepspeed is None:
        return
    block = thaw(recipe.deepspeed)
    rest = {k: v for k, v in block.items() if k != "optimizer"}
    yield from owned_problems(owned_keys(recipe, layout), rest, "$.deepspeed")
    if "optimizer" in block:
        yield from optimizer_problems(recipe, ds_optimizer(recipe.optimizer), block["optimizer"])
