"""A recipe as frozen dataclasses, and the conversion between them and the recipe's JSON data.

JSON keys equal the dataclass field names, except where Python forbids the name: ``"$schema"`` is
``Recipe.schema`` and ``batch.global`` is ``Batch.global_`` (each field's ``metadata["json"]`` says so).
No other shape is accepted: :func:`plugin.recipe.load.read_recipe` rejects unknown keys (with a "did you mean"),
wrong types and out-of-range values, all at once. Cross-field rules live in :mod:`plugin.recipe.checks`.

Pure: no torch, no deepspeed.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import RecipeError
from .layout import Layout, resolve_layout


def _json(key: str) -> dict:
    return {"json": key}


@dataclass(frozen=True)
class Parallelism:
    data: int | str = "auto"
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    expert_tensor: int | None = None

    @property
    def expert_tensor_resolved(self) -> int:
        """Tensor ranks each expert is split over: ``expert_tensor``, or the tensor degree when absent."""
        return self.tensor if self.expert_tensor is None else self.expert_tensor


@dataclass(frozen=True)
class Zero:
    stage: int = 0
    offload_optimizer: str = "none"
    offload_param: str = "none"
    nvme_path: str | None = None


@dataclass(frozen=True)
class TensorParallel:
    sequence_parallel: bool = False
    plan: str | Mapping[str, str] = "auto"


@dataclass(frozen=True)
class PipelineParallel:
    schedule: str = "1f1b"
    virtual_stages: int = 1
    partition: str = "parameters"


@dataclass(frozen=True)
class ContextParallel:
    """How attention spans the sequence split over ``parallelism.context`` ranks (:mod:`plugin.context_parallel`):
    ``"ring"`` passes keys and values around the context group, ``"all_to_all"`` (Ulysses) trades the sequence
    split for a head split around a whole-sequence attention."""
    method: str = "ring"


@dataclass(frozen=True)
class ActivationCheckpointing:
    """Recompute in backward: ``"none"``, ``"full"`` (spans of ``every`` consecutive blocks, each span's input
    kept) or ``"selective"`` (the attention core only). DeepSpeed's ``activation_checkpoint_interval`` k is
    ``full`` with ``every`` k."""
    mode: str = "none"
    every: int = 1

    @property
    def interval(self) -> int:
        """Layers per checkpointed span as DeepSpeed's ``pipeline.activation_checkpoint_interval`` counts
        them: ``every`` under full, 0 (off) otherwise."""
        return self.every if self.mode == "full" else 0


@dataclass(frozen=True)
class Batch:
    global_: int | None = field(default=None, metadata=_json("global"))
    micro: int | None = None
    grad_accum: int | None = None


@dataclass(frozen=True)
class LossScale:
    loss_scale: float = 0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: int = 1


@dataclass(frozen=True)
class Optimizer:
    name: str = "adamw"
    lr: float = 0.001
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-08
    momentum: float = 0.0


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate of each optimizer step (:mod:`plugin.recipe.lr_schedule` holds the formula): linear warmup
    from 0 over ``warmup_steps``, then ``decay`` (``constant``, ``linear`` or ``cosine``) from the optimizer's
    ``lr`` at step ``warmup_steps`` to ``min_lr`` at step ``decay_steps``, then ``min_lr``."""
    warmup_steps: int = 0
    decay: str = "constant"
    decay_steps: int | None = None
    min_lr: float = 0.0


@dataclass(frozen=True)
class Watchdog:
    """The hang guard (:mod:`plugin.watchdog`): ``timeout_s`` is the longest any rank may wait for its peers (in a
    collective, or for a peer's heartbeat) before every process reports and exits; also the process groups'
    timeout. The pre-flight gives each group ``min(timeout_s, 60)`` seconds for its first all-reduce."""
    timeout_s: float = 600

    @property
    def preflight_s(self) -> float:
        return min(float(self.timeout_s), 60.0)


@dataclass(frozen=True)
class MoE:
    """A mixture-of-experts feed-forward (:mod:`plugin.expert_parallel`) in place of the dense MLP of every
    ``every``-th block (blocks ``every - 1``, ``2 every - 1``, ...): ``experts`` experts of inner size
    ``ffn_hidden`` (absent: the model's), each token sent to its ``top_k`` by the ``router`` (``"softmax"``, or
    DeepSeek-V3's ``"sigmoid"`` with its score-correction bias moved by ``bias_update_rate`` after every step),
    dropless; the load-balancing loss times ``aux_loss_coef`` (and ST-MoE's router z-loss times ``z_loss_coef``) is
    added to the training loss."""
    experts: int
    top_k: int = 2
    every: int = 1
    ffn_hidden: int | None = None
    aux_loss_coef: float = 0.01
    router: str = "softmax"
    bias_update_rate: float = 0.001
    z_loss_coef: float = 0.0


@dataclass(frozen=True)
class Model:
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    dropout: float = 0.0
    moe: MoE | None = None

    @property
    def kv_heads_resolved(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def ffn_hidden_resolved(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.hidden


@dataclass(frozen=True)
class Cluster:
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80


@dataclass(frozen=True)
class Recipe:
    name: str
    batch: Batch
    description: str = ""
    parallelism: Parallelism = Parallelism()
    zero: Zero = Zero()
    tensor_parallel: TensorParallel = TensorParallel()
    pipeline_parallel: PipelineParallel = PipelineParallel()
    context_parallel: ContextParallel = ContextParallel()
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing()
    precision: str = "fp32"
    fp16: LossScale | None = None
    optimizer: Optimizer = Optimizer()
    lr_schedule: LRSchedule | None = None
    gradient_clipping: float = 1.0
    watchdog: Watchdog = Watchdog()
    model: Model | None = None
    cluster: Cluster | None = None
    launcher: str = "auto"
    deepspeed: Mapping[str, Any] | None = None
    schema: str | None = field(default=None, metadata=_json("$schema"))
    # Where the recipe was read from; not part of the JSON.
    source: str = field(default="", compare=False, repr=False, metadata={"json": None})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "") -> Recipe:
        """Build from a dict that already passed the schema (see :func:`read_recipe`)."""
        recipe = _build(cls, data)
        return dataclasses.replace(recipe, source=source) if source else recipe

    def to_dict(self) -> dict:
        """The JSON form: every field under its JSON key, ``None`` fields left out."""
        return _unbuild(self)

    def layout(self, world_size: int | None = None) -> Layout:
        """The resolved sizes (:class:`plugin.recipe.layout.Layout`); raises :class:`RecipeError` if they do not fit."""
        layout, problems = resolve_layout(self, world_size)
        if layout is None:
            raise RecipeError([p.with_file(self.source) for p in problems])
        return layout

    @property
    def fp16_resolved(self) -> LossScale:
        """The fp16 loss-scale block, or its defaults when the recipe gives none."""
        return self.fp16 if self.fp16 is not None else LossScale()

    @property
    def file_stem(self) -> str:
        return Path(self.source).stem if self.source else ""


# ---------------------------------------------------------------- dict <-> dataclass
def json_key(f: dataclasses.Field) -> str | None:
    return f.metadata.get("json", f.name)


def _target_class(annotation) -> type | None:
    """The dataclass inside ``Optional[X]`` / ``X``, if any."""
    candidates = typing.get_args(annotation) or (annotation,)
    for c in candidates:
        if dataclasses.is_dataclass(c):
            return c
    return None


def _freeze(value):
    if isinstance(value, dict):
        return types.MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def thaw(value):
    """A frozen value (a recipe field: mapping proxies, tuples) as plain JSON data: dicts and lists."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [thaw(v) for v in value]
    return value


@functools.cache
def _fields_of(cls) -> tuple:
    """(field name, JSON key, nested dataclass or None) for each JSON field of ``cls``; resolving the type
    hints is most of the cost of building a recipe, so it is done once per class."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, json_key(f), _target_class(hints[f.name])) for f in dataclasses.fields(cls)
                 if json_key(f) is not None)


def _build(cls, data: Mapping[str, Any]):
    kwargs = {}
    for name, key, sub in _fields_of(cls):
        if key not in data:
            continue
        value = data[key]
        kwargs[name] = _build(sub, value) if sub is not None and isinstance(value, Mapping) else _freeze(value)
    return cls(**kwargs)


def _unbuild(obj) -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        key = json_key(f)
        value = getattr(obj, f.name)
        if key is None or value is None:
            continue
        out[key] = _unbuild(value) if dataclasses.is_dataclass(value) else thaw(value)
    return out
