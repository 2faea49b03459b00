"""Error types of the plugin: problems are collected and reported together, never one by one.

A :class:`Problem` names where it is (file and JSON path), what is wrong (with the values) and what to
change. :class:`RecipeError` carries every problem found in one pass, so a user fixes a recipe in one go
instead of relaunching once per assertion.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ERROR = "error"
WARNING = "warning"


@dataclass(frozen=True)
class Problem:
    """One thing wrong (or worth a warning) in a recipe.

    ``path`` is a JSONPath-like string (``$.batch.global``); ``hint`` says what to change.
    """

    path: str
    message: str
    hint: str = ""
    severity: str = ERROR
    file: str = ""

    @property
    def is_error(self) -> bool:
        return self.severity == ERROR

    def with_file(self, file: str) -> Problem:
        return Problem(self.path, self.message, self.hint, self.severity, file)

    def format(self) -> str:
        """``FILE: $.json.path: what is wrong -> what to change`` (warnings are prefixed)."""
        where = f"{self.file}: " if self.file else ""
        tag = "warning: " if self.severity == WARNING else ""
        text = f"{where}{self.path}: {tag}{self.message}"
        if self.hint:
            text += f" -> {self.hint}"
        return text

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "path": self.path,
            "severity": self.severity,
            "message": self.message,
            "hint": self.hint,
        }


class PluginError(Exception):
    """Base class of every error the plugin raises on purpose."""


class RecipeError(PluginError):
    """A recipe (or its match with the runtime) is invalid; holds every problem found, not just the first."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems: tuple[Problem, ...] = tuple(problems)
        super().__init__(self._text())

    @property
    def errors(self) -> tuple[Problem, ...]:
        return tuple(p for p in self.problems if p.is_error)

    def _text(self) -> str:
        errors = [p for p in self.problems if p.is_error]
        head = f"{len(errors)} problem{'s' if len(errors) != 1 else ''} in the recipe:"
        return "\n".join([head] + ["  " + p.format() for p in errors])


def split(problems: Sequence[Problem]) -> tuple[list[Problem], list[Problem]]:
    """(errors, warnings) of a list of problems, each in its original order."""
    return [p for p in problems if p.is_error], [p for p in problems if not p.is_error]
