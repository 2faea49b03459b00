"""Model presets (``models.json`` beside this file, shipped in the wheel) and ``--model`` resolution.

``--model`` takes a preset name (``llama2-7b``; case, ``-`` and ``_`` do not matter) or a JSON
file: a recipe ``model`` block (optionally with the architecture keys of :class:`plugin.planning.dims.ModelSpec`;
those left out are the reference GPT's), or a whole recipe, whose ``model`` block is used. Pure.
"""
from __future__ import annotations

import difflib
import functools
import json
import re
from pathlib import Path

from ...errors import Problem, RecipeError
from ..dims import ModelSpec, spec_from_dict

_FILE = Path(__file__).resolve().parent / "models.json"


def _key(name: str) -> str:
    return re.sub(r"[-_\s]", "", name.lower())  # keep ".": gpt3-1.3b is not gpt3-13b


@functools.lru_cache(maxsize=1)
def _presets() -> dict[str, ModelSpec]:
    with open(_FILE, encoding="utf-8") as f:
        data = json.load(f)
    out: dict[str, ModelSpec] = {}
    for entry in data["presets"]:
        if any(_key(entry["name"]) == _key(n) for n in out):
            raise AssertionError(f"preset {entry['name']!r} is indistinguishable from another name")
        spec, problems = spec_from_dict(entry, name=entry["name"], where=f"presets[{entry['name']}]")
        if spec is None:  # a broken shipped file is a bug, not a user error
            raise AssertionError("; ".join(p.format() for p in problems))
        out[entry["name"]] = spec
    return out


def preset_names() -> list[str]:
    return list(_presets())


def get_preset(name: str) -> ModelSpec:
    """A preset by name; raises :class:`RecipeError` with a "did you mean" for an unknown one."""
    presets = _presets()
    by_key = {_key(n): n for n in presets}
    if _key(name) in by_key:
        return presets[by_key[_key(name)]]
    close = difflib.get_close_matches(_key(name), list(by_key), n=3, cutoff=0.5)
    hint = ("did you mean " + " or ".join(by_key[c] for c in close) + "?") if close else \
        "use a preset (" + ", ".join(presets) + ") or a path to a JSON model block"
    raise RecipeError([Problem("--model", f"no model preset named {name!r} and no such file", hint)])


def resolve_model(ref: str | Path) -> ModelSpec:
    """``--model``: a preset name or a JSON file (a model block, or a recipe with one)."""
    path = Path(ref)
    if not path.is_file():
        if path.suffix.lower() == ".json" or "/" in str(ref):
            raise RecipeError([Problem("--model", f"model file {str(ref)!r} does not exist",
                                       "check the path, or give a preset name: " + ", ".join(preset_names()))])
        return get_preset(str(ref))
    from ...recipe.jsontext import parse_json

    data, problems = parse_json(path.read_text(encoding="utf-8"), str(path))
    if any(p.is_error for p in problems):  # not JSON (or not standard JSON)
        raise RecipeError(problems)
    where = "$"
    if isinstance(data, dict) and "model" in data and isinstance(data["model"], dict):
        data, where = data["model"], "$.model"
    spec, more = spec_from_dict(data, name=path.stem, where=where)
    if spec is None:
        raise RecipeError([p.with_file(str(path)) for p in problems + more])
    return spec
