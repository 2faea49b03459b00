"""Recipe text -> JSON value, reporting what Python's json module lets through but JSON does not.

A syntax error, a NaN / Infinity (``json.loads`` accepts both) and a number too large for a float name
line and column; a repeated key (JSON keeps only the last) is reported at the path of the object that
repeats it. Pure: no torch.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import Any

from ..errors import Problem


class _Invalid:
    """The type of :data:`INVALID`."""

    def __repr__(self) -> str:
        return "INVALID"


# What parse_json returns for text that is not (standard) JSON; ``None`` is the valid document ``null``.
INVALID = _Invalid()


class _NonFinite:
    """Stands in for a NaN / Infinity (or an overflowing number such as 1e999) while the text is parsed."""

    def __init__(self, token: str):
        self.token = token


# Strings (skipped) and the tokens Python's json module reads but JSON does not allow.
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|-?Infinity|NaN|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?')


def _line_col(text: str, at: int) -> tuple[int, int]:
    return text.count("\n", 0, at) + 1, at - (text.rfind("\n", 0, at) + 1) + 1


def _is_float_token(tok: str) -> bool:
    """Whether Python's json module reads this number token as a float (integers go to ``int``)."""
    return any(c in tok for c in ".eE")


def _nonfinite_positions(text: str) -> list[tuple[str, int, int]]:
    """(token, line, column) of every NaN, Infinity or overflowing float outside strings, in order: the
    tokens json hands to ``parse_constant`` or ``parse_float`` as something infinite, in the order it reads them."""
    out = []
    for m in _TOKENS.finditer(text):
        tok = m.group()
        if tok.startswith('"'):
            continue
        if tok[-1] in "yN" or (_is_float_token(tok) and math.isinf(float(tok))):
            out.append((tok, *_line_col(text, m.start())))
    return out


def _too_long_integer(text: str, limit: int) -> tuple[str, int, int]:
    """(shortened token, line, column) of the first integer with more than ``limit`` digits."""
    for m in _TOKENS.finditer(text):
        tok = m.group()
        if not tok.startswith('"') and not _is_float_token(tok) and len(tok.lstrip("-")) > limit:
            return tok[:12] + "...", *_line_col(text, m.start())
    return "", 0, 0


def json_path(parts: Iterable[Any]) -> str:
    """``$.batch.global``, ``$.deepspeed["a b"]``, ``$.x[0]``: the JSONPath-like name of a place in a document."""
    out = "$"
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif isinstance(p, str) and p.replace("_", "").isalnum():
            out += f".{p}"
        else:
            out += f"[{json.dumps(p)}]"
    return out


def json_type(value) -> str:
    """JSON's name for the type of a parsed value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return {dict: "an object", list: "an array", str: "a string"}.get(type(value), "a number")


def walk_json(value, path: str = "$"):
    """(path, value) of every node, in document order."""
    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from walk_json(v, path + json_path([k])[1:])
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from walk_json(v, f"{path}[{i}]")


def parse_json(text: str, file: str = "") -> tuple[Any, list[Problem]]:
    """JSON text -> ``(value, problems)``; ``value`` is :data:`INVALID` when the text is not standard JSON.

    A syntax error, and a NaN / Infinity (which Python's json module would accept), name line and column;
    a repeated key is reported at the path of the object that repeats it.
    """
    repeated: list[tuple[dict, list[str]]] = []  # keeps each dict alive, so its id stays unique
    nonfinite: list[_NonFinite] = []

    def pairs(items):
        seen: dict = {}
        again = []
        for k, v in items:
            if k in seen and k not in again:
                again.append(k)
            seen[k] = v
        if again:
            repeated.append((seen, again))
        return seen

    def constant(token):
        nonfinite.append(_NonFinite(token))
        return nonfinite[-1]

    def number(token):
        value = float(token)
        return constant(token) if math.isinf(value) else value

    try:
        value = json.loads(text, object_pairs_hook=pairs, parse_constant=constant, parse_float=number)
    except json.JSONDecodeError as e:
        return INVALID, [Problem("$", f"invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}",
                                 "fix the JSON syntax there (a trailing comma, a missing comma or an unquoted key "
                                 "are the usual causes)", file=file)]
    except RecursionError:
        return INVALID, [Problem("$", "the JSON nests too deeply to read", "flatten it", file=file)]
    except ValueError as e:  # Python's cap on int digits (sys.get_int_max_str_digits(), 4300 by default)
        import sys

        limit = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 4300
        tok, line, col = _too_long_integer(text, limit)
        what = (f"invalid number at line {line}, column {col}: {tok} has more than {limit} digits" if line
                else f"unreadable JSON: {e}")
        return INVALID, [Problem("$", what, "write a number of reasonable size", file=file)]
    paths = {}
    if repeated or nonfinite:
        paths = {id(v): p for p, v in walk_json(value)}
    problems = []
    if nonfinite:
        where = _nonfinite_positions(text)
        for i, node in enumerate(nonfinite):
            tok, line, col = where[i] if i < len(where) else (node.token, 0, 0)
            at = f"line {line}, column {col}" if line else "somewhere in the file"
            why = "JSON has no NaN or Infinity" if tok[-1] in "yN" else "it is too large for a float"
            problems.append(Problem(paths.get(id(node), "$"), f"invalid JSON at {at}: {tok} is not a finite "
                                    f"number ({why})", "write a finite number", file=file))
    for obj, keys in repeated:
        where = paths.get(id(obj), "$")
        for k in keys:
            last = json.dumps(obj[k], default=lambda o: o.token if isinstance(o, _NonFinite) else str(o))
            last = last if len(last) <= 40 else last[:37] + "..."
            problems.append(Problem(where, f"key {json.dumps(k)} appears more than once in this object (JSON "
                                    f"keeps only the last, {last})", "keep one of them", file=file))
    return (INVALID if nonfinite else value), problems
