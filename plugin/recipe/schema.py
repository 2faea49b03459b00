"""JSON Schema validation of a recipe, with each error turned into a :class:`Problem` that says what to change.

Draft 2020-12, with an empty reference registry: a ``$ref`` that leaves the schema file is an error,
never a network fetch.
"""
from __future__ import annotations

import difflib
import functools
import json
import math
from collections.abc import Iterable
from typing import Any

from ..errors import Problem
from .jsontext import json_path, json_type, walk_json
from .paths import schema_path


@functools.lru_cache(maxsize=1)
def load_schema() -> dict:
    with open(schema_path(), encoding="utf-8") as f:
        return json.load(f)


@functools.lru_cache(maxsize=1)
def _validator():
    import jsonschema
    from referencing import Registry

    schema = load_schema()
    base = jsonschema.Draft202012Validator
    # JSON Schema counts 2.0 as an integer; the recipe does not (2.0 would reach range() and the exported
    # ds_config as a float), so "integer" means a JSON number written without a fraction or exponent.
    types = base.TYPE_CHECKER.redefine("integer", lambda _, v: isinstance(v, int) and not isinstance(v, bool))
    cls = jsonschema.validators.extend(base, type_checker=types)
    # An empty registry that retrieves nothing: references resolve inside this schema file only.
    return cls(schema, registry=Registry(), format_checker=base.FORMAT_CHECKER)


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    if not close:
        close = [c for c in choices if str(c).lower() == str(word).lower()]
    return f"did you mean {json.dumps(close[0])}?" if close else ""


# Words for the schema's string patterns.
_FORMS = {
    "^[A-Za-z0-9_.-]+$": 'letters, digits, "_", "." and "-" only',
    "^(parameters|uniform|type:.+)$": '"parameters", "uniform" or "type:REGEX" (a regex over layer class names)',
}


def _describe(schema: dict) -> str:
    """Words for what a (sub)schema accepts."""
    if "const" in schema:
        return json.dumps(schema["const"])
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(v) for v in schema["enum"])
    kind = schema.get("type", "value")
    words = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false",
             "object": "an object", "array": "an array"}.get(kind, f"a {kind}")
    bounds = []
    if "minimum" in schema:
        bounds.append(f">= {schema['minimum']}")
    if "exclusiveMinimum" in schema:
        bounds.append(f"> {schema['exclusiveMinimum']}")
    if "maximum" in schema:
        bounds.append(f"<= {schema['maximum']}")
    if "exclusiveMaximum" in schema:
        bounds.append(f"< {schema['exclusiveMaximum']}")
    return words + (" " + " and ".join(bounds) if bounds else "")


def _integral_float(inst, schema: dict) -> bool:
    """``inst`` is a float like 2.0 where the (sub)schema, or one of its alternatives, wants an integer."""
    if not (isinstance(inst, float) and inst.is_integer()):
        return False
    alternatives = schema.get("anyOf", []) + schema.get("oneOf", []) + [schema]
    return any(alt.get("type") == "integer" for alt in alternatives)


def _moved_interval(value) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return (f'write "activation_checkpointing": {{"mode": "full", "every": {value}}} at the top level of the '
                "recipe and drop this key (the same recompute: spans of "
                f"{value} layer{'s' if value != 1 else ''}, on every layout now)")
    if value == 0:
        return 'drop this key (0 was off, the default: "activation_checkpointing": {"mode": "none"})'
    return ('write "activation_checkpointing": {"mode": "full", "every": K} at the top level (K layers per '
            "checkpointed span) and drop this key")


# Keys that were part of the recipe and moved: ((parent path), key) -> (new JSON path, the fix for a value).
MOVED = {
    (("pipeline_parallel",), "activation_checkpoint_interval"): ("$.activation_checkpointing", _moved_interval),
}
# Keys a later axis will take, refused with what runs instead today.
NOT_YET: dict = {}  # none today: parallelism.expert, the last one, is an axis now (plugin/expert_parallel)


def _problem(error) -> list[Problem]:
    path = json_path(error.absolute_path)
    v, schema, inst = error.validator, error.schema, error.instance
    shown = json.dumps(inst) if not isinstance(inst, (dict, list)) else type(inst).__name__
    if v in ("type", "anyOf", "oneOf") and _integral_float(inst, schema):
        return [Problem(path, f"{shown} is a float, and this field takes a whole number",
                        f"write {int(inst)}, not {shown}")]
    if v == "additionalProperties":
        allowed = list(schema.get("properties", {}))
        out = []
        for key in inst:
            if key in allowed:
                continue
            moved = MOVED.get((tuple(str(p) for p in error.absolute_path), key))
            if moved is not None:
                new_path, fix = moved
                out.append(Problem(json_path(list(error.absolute_path) + [key]),
                                   f"{json.dumps(key)} moved to {new_path} (activation checkpointing is its own "
                                   "block now, for every layout)", fix(inst[key])))
                continue
            not_yet = NOT_YET.get((tuple(str(p) for p in error.absolute_path), key))
            if not_yet is not None:
                out.append(Problem(json_path(list(error.absolute_path) + [key]), *not_yet))
                continue
            hint = _did_you_mean(key, allowed) or ("allowed keys: " + ", ".join(allowed) if allowed else "remove it")
            out.append(Problem(json_path(list(error.absolute_path) + [key]), f"unknown key {json.dumps(key)}", hint))
        return out
    if v == "required":
        missing = [k for k in error.validator_value if k not in inst]
        return [Problem(json_path(list(error.absolute_path) + [k]), f"{json.dumps(k)} is required",
                        f"add it: {(schema.get('properties', {}).get(k, {}).get('description') or '').rstrip('.')}")
                for k in missing]
    if v == "enum":
        hint = _did_you_mean(inst, error.validator_value) if isinstance(inst, str) else ""
        return [Problem(path, f"{shown} is not allowed",
                        (hint + " " if hint else "") + "use " + _describe(schema))]
    if v in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "type", "const"):
        return [Problem(path, f"{shown} is not {_describe(schema)}", f"use {_describe(schema)}")]
    if v in ("anyOf", "oneOf"):
        alts = " or ".join(_describe(s) for s in error.validator_value)
        hint = ""
        if isinstance(inst, str):
            consts = [s["const"] for s in error.validator_value if "const" in s]
            hint = _did_you_mean(inst, consts)
        if isinstance(inst, dict):  # an object alternative failed inside: report its own errors
            subs = [e for e in error.context if e.validator != "const" and e.validator != "type"]
            if subs:
                return [q for e in subs for q in _problem(e)]
        return [Problem(path, f"{shown} is not {alts}", (hint + " " if hint else "") + f"use {alts}")]
    if v == "minProperties":
        return [Problem(path, "is empty", f"give at least {error.validator_value} key(s): "
                        + ", ".join(schema.get("properties", {})) if schema.get("properties") else "add an entry")]
    if v in ("minItems", "maxItems"):
        n = len(inst)
        exact = schema.get("minItems") == schema.get("maxItems")
        want = f"exactly {schema.get('minItems')}" if exact else \
            (f"at least {schema['minItems']}" if v == "minItems" else f"at most {schema['maxItems']}")
        example = schema.get("examples", [None])[0]
        return [Problem(path, f"{json.dumps(inst)} has {n} item{'s' if n != 1 else ''}",
                        f"give {want}" + (f", e.g. {json.dumps(example)}" if example is not None else ""))]
    if v == "pattern":
        examples = [e for e in schema.get("examples", []) if isinstance(e, str)]
        close = _did_you_mean(inst, examples) if isinstance(inst, str) else ""
        form = _FORMS.get(error.validator_value, f"a string matching {error.validator_value}")
        return [Problem(path, f"{shown} does not have the expected form",
                        (close + " " if close else "") + f"write {form}")]
    if v == "minLength":
        if "propertyNames" in error.schema_path:  # an empty key of a map (jsonschema gives the map's path)
            return [Problem(path, 'has an empty key ""', f"name {schema.get('description', 'something')} there")]
        what = (schema.get("description") or "").rstrip(".")
        return [Problem(path, f"{shown} is empty", "give a non-empty string" + (f": {what}" if what else ""))]
    return [Problem(path, error.message, schema.get("description", "see schemas/recipe.schema.json"))]


def _nonfinite(value) -> Iterable[Problem]:
    """NaN and infinities anywhere (a dict built in Python; recipe text with them never parses)."""
    for path, v in walk_json(value):
        if isinstance(v, float) and not math.isfinite(v):
            yield Problem(path, f"{v} is not a finite number (JSON has no NaN or Infinity)", "write a finite number")


def schema_problems(data: Any) -> list[Problem]:
    """Every schema violation in ``data`` as problems, in document order."""
    if not isinstance(data, dict):
        return [Problem("$", f"the top level must be a JSON object (a recipe), not {json_type(data)}",
                        'write an object such as {"name": "mine", "batch": {"micro": 4}}, or copy a shipped '
                        "recipe (recipes/cpu_single.json)")]
    errors = sorted(_validator().iter_errors(data), key=lambda e: [str(p) for p in e.absolute_path])
    out: list[Problem] = list(_nonfinite(data))
    for e in errors:
        for p in _problem(e):
            if p not in out:
                out.append(p)
    return out
