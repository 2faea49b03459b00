"""The manifest (``plugin-checkpoint.json``, pure: no torch): what a checkpoint holds, who wrote it, and whether a
recipe and model can load it. ``inspect`` and ``check`` read it alone, without torch and without unpickling.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import PluginError, Problem
from .directory import MANIFEST

FORMAT, VERSION = "plugin-checkpoint", 1
DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1,
               "int8": 1, "bool": 1}


def read_manifest(step_dir: str | Path) -> dict:
    path = Path(step_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except OSError as e:
        raise PluginError(f"{path}: cannot be read ({e.strerror}) -> resume from a directory written by --save") \
            from None
    except ValueError as e:
        raise PluginError(f"{path}: not valid JSON ({e}) -> the file is damaged; resume from another step") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise PluginError(f"{path}: format {manifest.get('format')!r} version {manifest.get('version')!r}, expected "
                          f"{FORMAT!r} version {VERSION} -> written by another plugin version")
    return manifest


def tensor_bytes(info: dict) -> int:
    return math.prod(info["shape"]) * DTYPE_BYTES.get(info["dtype"], 4)


def check_files(step_dir: Path, manifest: dict) -> list[str]:
    """Files the manifest records that are missing or not of their recorded size (a truncated write)."""
    bad = []
    for name, rec in manifest.get("files", {}).items():
        path = step_dir / name
        if not path.exists():
            bad.append(f"{path}: missing")
        elif path.stat().st_size != rec["size"]:
            bad.append(f"{path}: {path.stat().st_size} bytes, the manifest recorded {rec['size']} (truncated or "
                       "overwritten)")
    return bad


def model_problems(manifest: dict, names_shapes: dict[str, tuple]) -> list[Problem]:
    """Every difference between the checkpoint's model tensors and this model's ``{name: shape}``, all at once."""
    saved = {n: tuple(t["shape"]) for n, t in manifest["tensors"].items() if t["role"] == "param"}
    problems = []
    for n in sorted(set(names_shapes) - set(saved)):
        problems.append(Problem(f"$.tensors.{n}", f"this model has {n} {list(names_shapes[n])}, the checkpoint "
                                "does not", "load a checkpoint of this model"))
    for n in sorted(set(saved) - set(names_shapes)):
        problems.append(Problem(f"$.tensors.{n}", f"the checkpoint has {n} {list(saved[n])}, this model does not",
                                "load a checkpoint of this model"))
    for n in sorted(set(saved) & set(names_shapes)):
        if saved[n] != tuple(names_shapes[n]):
            problems.append(Problem(f"$.tensors.{n}", f"{n}: checkpoint shape {list(saved[n])}, this model "
                                    f"{list(names_shapes[n])}", "load a checkpoint of this model"))
    return problems


def recipe_problems(manifest: dict, recipe, global_batch: int | None = None) -> list[Problem]:
    """The recipe's model block against the one that wrote the checkpoint (errors), and notes for what a loading
    recipe may change (layout, back end, precision) or should not (global batch: what step i means)."""
    problems = []
    saved = (manifest.get("recipe") or {}).get("model") or {}
    model = recipe.model
    if model is not None and saved:
        import dataclasses

        for key, was in sorted(saved.items()):
            now = getattr(model, key, None)
            if dataclasses.is_dataclass(now):  # a nested block (model.moe), saved as its dict
                now = dataclasses.asdict(now)
            if now is not None and now != was and key != "dropout":
                problems.append(Problem(f"$.model.{key}", f"checkpoint {was}, recipe {now}",
                                        f'set "{key}": {json.dumps(was)} or load a checkpoint of this model'))
    was_batch = (manifest.get("layout") or {}).get("global_batch")
    if was_batch is not None and global_batch is not None and was_batch != global_batch:
        problems.append(Problem("$.batch.global", f"checkpoint trained with global batch {was_batch}, recipe "
                                f"{global_batch}: step i then means other rows", "keep the global batch",
                                severity="warning"))
    saved_opt = (manifest.get("optimizer") or {}).get("name")
    now_opt = recipe.optimizer.name
    family = {"adam": "adam", "adamw": "adam", "sgd": "sgd"}
    if saved_opt and family.get(saved_opt, saved_opt) != family.get(now_opt, now_opt):
        problems.append(Problem("$.optimizer.name", f"checkpoint optimizer {saved_opt}, recipe {now_opt}: their states "
                                "differ", f'set "name": "{saved_opt}"'))
    return problems
