"""An Accelerate config (``accelerate launch --config_file``, YAML) read back as a recipe: the inverse of
:mod:`.accelerate_config`, for ``python -m plugin import``. Pure: no accelerate import.

The YAML is read with PyYAML's safe loader, as Accelerate reads it (imported only here: Accelerate installs it).
What the YAML cannot say comes from the export's ``# recipe:`` line where it agrees with ``num_processes``.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..errors import ERROR, WARNING, Problem
from .accelerate_config import RECIPE_LINE
from .precision import PRECISIONS

# distributed types that are one process per device and plain DDP (no sharding of Accelerate's own)
_DDP = frozenset({"NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU",
                  "MULTI_HPU", "MULTI_NEURON"})
# Accelerate's DeepSpeed plugin keys this import reads; the rest of its block is said as not read
_DS_READ = frozenset({"zero_stage", "offload_optimizer_device", "offload_param_device", "offload_optimizer_nvme_path",
                      "offload_param_nvme_path", "gradient_accumulation_steps", "gradient_clipping"})
_DS_LAUNCH = frozenset({"zero3_init_flag", "deepspeed_multinode_launcher", "deepspeed_hostfile"})  # no training meaning


def parse_yaml(text: str, file: str = "") -> tuple[Any, list[Problem]]:
    """YAML text -> ``(value or None, problems)``, read by PyYAML's safe loader as Accelerate reads its configs."""
    try:
        import yaml
    except ImportError:
        return None, [Problem("$", "reading an Accelerate config (YAML) needs PyYAML, which is not installed",
                              "pip install pyyaml (Accelerate installs it)", file=file)]
    try:
        return yaml.safe_load(text), []
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = getattr(e, "problem", None) or str(e)
        return None, [Problem("$", f"not YAML: {where}{what}", "fix the YAML there", file=file)]


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class _Reading:
    """What the import has read so far: the recipe's values, and the problems (paths in the Accelerate config)."""

    def __init__(self):
        self.world: int | None = None
        self.tensor, self.pipeline, self.context, self.method = 1, 1, 1, "ring"
        self.zero, self.offload, self.batch, self.clip = 0, {}, {}, None
        self.problems: list[Problem] = []

    def say(self, path: str, message: str, hint: str, severity: str = WARNING) -> None:
        self.problems.append(Problem(path, message, hint, severity))


def from_accelerate_config(cfg: Mapping, text: str = "", world_size: int | None = None,
                           name: str = "imported") -> tuple[dict, list[Problem]]:
    """A recipe (as JSON data) from an Accelerate config (``cfg``: its parsed YAML; ``text``: the file, for the
    export's ``# recipe:`` line), and the problems found on the way (paths in the Accelerate config's keys).

    ``num_processes`` (or ``world_size``) is the world; ``num_machines`` > 1 the cluster's nodes; ``mixed_precision``
    the precision; Accelerate's DeepSpeed plugin gives the ZeRO stage, offload, accumulation and clipping, its FSDP
    plugin the ZeRO stage of its sharding strategy, its ``parallelism_config`` the tensor degree and a context degree
    (``cp_size``: ring attention; ``sp_size``: all-to-all, DeepSpeed's Ulysses). The ``# recipe:`` line, when it
    agrees with the world, gives the rest: pipeline, batch, and the ZeRO stage a plain launch cannot say. The
    launcher is ``"accelerate"``.
    """
    r = _Reading()
    kind = str(cfg.get("distributed_type") or "NO").upper()
    n = cfg.get("num_processes")
    if world_size is not None and _count(n) and n != world_size:
        r.say("$.num_processes", f"{n} processes, but --world-size {world_size}", "drop --world-size, or make them "
              "agree", ERROR)
    r.world = world_size or (n if _count(n) else None)
    _parallelism(cfg.get("parallelism_config"), r)
    if kind == "DEEPSPEED":
        _deepspeed(cfg.get("deepspeed_config"), r)
    elif kind == "FSDP":
        _fsdp(cfg.get("fsdp_config"), r)
    elif kind not in _DDP:
        r.say("$.distributed_type", f"{kind} has no recipe equivalent", "import a DEEPSPEED, FSDP or multi-process "
              "(MULTI_GPU, MULTI_CPU) config", ERROR)
    line = RECIPE_LINE.search(text)
    if line is not None:
        _recipe_line_values(line, r, plain=kind in _DDP)
    else:
        r.say("$", "an Accelerate config holds no batch size, model, optimizer or pipeline stages: the recipe takes "
              "micro 1, no model block and the defaults", "set $.batch, $.model and $.optimizer in the recipe to what "
              "the script uses")
    model_ranks = r.tensor * r.pipeline * r.context
    if r.world is not None and r.world % model_ranks:
        r.say("$.num_processes", f"{r.world} processes do not split into tensor {r.tensor} x pipeline {r.pipeline} x "
              f"context {r.context}", "make num_processes a multiple of their product", ERROR)
    data: Any = r.world // model_ranks if r.world is not None and r.world % model_ranks == 0 else "auto"
    recipe: dict[str, Any] = {"$schema": "../schemas/recipe.schema.json", "name": name,
                              "description": "Imported from an Accelerate config.",
                              "parallelism": {"data": data, "tensor": r.tensor, "pipeline": r.pipeline,
                                              **({"context": r.context} if r.context > 1 else {})}}
    if r.context > 1:
        recipe["context_parallel"] = {"method": r.method}
    if r.zero or r.offload:
        recipe["zero"] = {"stage": r.zero, **r.offload}
    recipe["batch"] = r.batch or {"micro": 1}
    recipe["precision"] = _precision(cfg.get("mixed_precision", "no"), r)
    if r.clip is not None:
        recipe["gradient_clipping"] = r.clip
    machines = cfg.get("num_machines")
    if _count(machines) and machines > 1 and r.world is not None and r.world % machines == 0:
        recipe["cluster"] = {"nodes": machines, "gpus_per_node": r.world // machines}
    recipe["launcher"] = "accelerate"
    return recipe, r.problems


def _recipe_line_values(line: re.Match, r: _Reading, *, plain: bool) -> None:
    """The export's ``# recipe:`` line into ``r``, where it agrees with the world (else it is said and ignored); its
    ZeRO stage only for a ``plain`` launch (DDP types), whose YAML cannot say one."""
    v = {k: (float(x) if k == "clip" else int(x) if x.isdigit() else x) for k, x in line.groupdict().items()
         if x is not None}
    degrees = v["data"] * v["tensor"] * v["pipeline"] * v.get("context", 1)
    if r.world is not None and degrees != r.world:
        r.say("$", f"the '# recipe:' line says {degrees} processes, num_processes {r.world}: that line is ignored",
              "set $.parallelism and $.batch in the recipe to what the job runs")
        return
    r.world, r.tensor, r.pipeline, r.context = degrees, v["tensor"], v["pipeline"], v.get("context", 1)
    r.method = v.get("method", r.method)
    if plain:  # a DeepSpeed block says these itself
        r.zero = v["zero"]
        r.offload = {k: v[k] for k in ("offload_optimizer", "offload_param") if v.get(k, "none") != "none"}
    r.clip = v["clip"] if r.clip is None else r.clip
    ga = r.batch.get("grad_accum", v["grad_accum"])
    if ga == v["grad_accum"]:
        r.batch = {"global": v["global"], "micro": v["micro"]}
        return
    r.say("$.deepspeed_config.gradient_accumulation_steps", f"{ga}, where the '# recipe:' line says "
          f"{v['grad_accum']}: the batch is taken as micro {v['micro']} x grad_accum {ga}",
          "set $.batch in the recipe to what the job runs")
    r.batch = {"micro": v["micro"], "grad_accum": ga}


def _precision(value, r: _Reading) -> str:
    """Accelerate's ``mixed_precision`` -> the recipe's precision (``no``, which YAML 1.1 reads as false: fp32)."""
    if value in (None, False, "no"):
        return "fp32"
    by_accelerate = {p.accelerate: p.name for p in PRECISIONS.values()}
    if value in by_accelerate:
        return by_accelerate[value]
    r.say("$.mixed_precision", f"{value!r} has no recipe precision", f"use one of {', '.join(sorted(by_accelerate))} "
          '("no" is fp32)', ERROR)
    return "fp32"


def _parallelism(block, r: _Reading) -> None:
    """The tensor and context degrees of Accelerate's ``parallelism_config`` (its data sizes follow from the world):
    ``cp_size`` is torch's ring attention, ``sp_size`` DeepSpeed's Ulysses (all-to-all)."""
    if not isinstance(block, Mapping):
        return
    size = {k: block.get(f"parallelism_config_{k}_size") for k in ("tp", "cp", "sp")}
    size = {k: v if _count(v) else 1 for k, v in size.items()}
    if size["cp"] > 1 and size["sp"] > 1:
        r.say("$.parallelism_config", f"cp_size {size['cp']} and sp_size {size['sp']}: the recipe has one context "
              "axis", "keep one of them", ERROR)
    r.tensor = size["tp"]
    r.context, r.method = (size["sp"], "all_to_all") if size["sp"] > 1 else (size["cp"], "ring")


def _deepspeed(block, r: _Reading) -> None:
    """ZeRO stage (Accelerate's default 2), offload, accumulation and clipping of Accelerate's DeepSpeed plugin."""
    block = block if isinstance(block, Mapping) else {}
    if block.get("deepspeed_config_file"):
        f = block["deepspeed_config_file"]
        r.say("$.deepspeed_config.deepspeed_config_file", f"the DeepSpeed settings are in {f}",
              f"import that file instead: python -m plugin import {f} --world-size N", ERROR)
    unread = sorted(set(block) - _DS_READ - _DS_LAUNCH - {"deepspeed_config_file"})
    if unread:
        r.say("$.deepspeed_config", f"not read: {', '.join(unread)} (no recipe field)", "set them in the recipe's "
              "$.deepspeed block, if the job needs them")
    r.zero = block.get("zero_stage", 2)
    for kind in ("optimizer", "param"):
        device = block.get(f"offload_{kind}_device")
        if device not in (None, "none"):
            r.offload[f"offload_{kind}"] = device
        path = block.get(f"offload_{kind}_nvme_path")
        if device == "nvme" and path not in (None, "none"):
            r.offload["nvme_path"] = path
    ga, clip = block.get("gradient_accumulation_steps"), block.get("gradient_clipping")
    if _count(ga):
        r.batch = {"micro": 1, "grad_accum": ga}
    if isinstance(clip, (int, float)) and not isinstance(clip, bool):
        r.clip = float(clip)


def _fsdp(block, r: _Reading) -> None:
    """The ZeRO stage of Accelerate's FSDP plugin: FULL_SHARD 3, SHARD_GRAD_OP 2, NO_SHARD 0 (FSDP2: resharding
    after forward 3, else 2)."""
    block = block if isinstance(block, Mapping) else {}
    if str(block.get("fsdp_version", 1)) == "2":
        r.zero = 3 if block.get("fsdp_reshard_after_forward", True) else 2
        return
    strategy = str(block.get("fsdp_sharding_strategy", "FULL_SHARD")).upper()
    stages = {"FULL_SHARD": 3, "1": 3, "SHARD_GRAD_OP": 2, "2": 2, "NO_SHARD": 0, "3": 0}
    if strategy not in stages:
        r.say("$.fsdp_config.fsdp_sharding_strategy", f"{strategy} has no recipe equivalent: taken as ZeRO-3",
              "use FULL_SHARD, SHARD_GRAD_OP or NO_SHARD")
    r.zero = stages.get(strategy, 3)
