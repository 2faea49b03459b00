"""Finding and reading a recipe: a shipped recipe's name or a path -> text -> JSON -> schema -> :class:`Recipe`.

Every problem on the way (a missing file, invalid JSON, a schema violation) is a :class:`~plugin.errors.Problem`
with the file and JSON path; cross-field rules come after, in :mod:`plugin.recipe.checks`. Pure: no torch.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from ..errors import Problem, RecipeError
from .foreign import accelerate_yaml, deepspeed_config, empty_file
from .jsontext import INVALID, parse_json
from .paths import recipes_dir
from .schema import schema_problems
from .spec import Recipe


def shipped_recipes() -> list[Path]:
    """The recipes that come with the plugin, sorted by name."""
    return sorted(recipes_dir().glob("*.json"))


def find_recipe(ref: str | Path) -> Path:
    """A recipe file from a path, or from a shipped recipe's name (``tp2_dp4`` or ``tp2_dp4.json``)."""
    path = Path(ref)
    if path.is_file():
        return path
    if path.parent == Path(".") or str(path.parent) == "":
        name = path.name if path.suffix == ".json" else path.name + ".json"
        shipped = {p.name: p for p in shipped_recipes()}
        if name in shipped:
            return shipped[name]
        stems = sorted(n[:-5] for n in shipped)
        close = difflib.get_close_matches(name[:-5], stems, n=3, cutoff=0.7)
        hint = f"did you mean {' or '.join(close)}?" if close else \
            f"give a path, or one of the shipped recipes: {', '.join(stems)}"
        if not path.is_dir():
            raise RecipeError([Problem("$", f"no recipe file {str(ref)!r} and no shipped recipe of that name", hint,
                                       file=str(ref))])
    if path.is_dir():
        inside = sorted(path.glob("*.json"))
        hint = (f"give a recipe file, e.g. {inside[0]} (one of {len(inside)} .json files there)" if inside else
                "give a recipe file (JSON)")
        raise RecipeError([Problem("$", f"{str(ref)!r} is a directory, not a recipe file", hint, file=str(ref))])
    raise RecipeError([Problem("$", f"recipe file {str(ref)!r} does not exist", "check the path", file=str(ref))])


def read_recipe(ref: str | Path) -> Recipe:
    """Read, parse and schema-validate a recipe; raise :class:`RecipeError` with every problem found.

    Cross-field rules (world size, batch triple, divisibility...) are :func:`plugin.recipe.checks.check_recipe`'s.
    """
    recipe, problems = read_recipe_problems(ref)
    if recipe is None:
        raise RecipeError(problems)
    return recipe


def read_recipe_problems(ref: str | Path) -> tuple[Recipe | None, list[Problem]]:
    """Like :func:`read_recipe` but returns ``(recipe or None, problems)`` instead of raising."""
    try:
        path = find_recipe(ref)
    except RecipeError as e:
        return None, list(e.problems)
    file = str(ref) if Path(ref).is_file() else str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        return None, [Problem("$", f"cannot read the file: {e}", "check the path and its permissions", file=file)]
    return recipe_from_text(text, file)


def recipe_from_text(text: str, file: str = "") -> tuple[Recipe | None, list[Problem]]:
    """Text -> ``(recipe or None, problems)``; an empty file, an Accelerate YAML or a DeepSpeed config is said as such
    (:mod:`.foreign`) instead of as JSON or schema errors."""
    empty = empty_file(text, file)
    if empty is not None:
        return None, [empty]
    data, problems = parse_json(text, file)
    if data is INVALID:
        yaml = accelerate_yaml(text, file)
        return None, [yaml] if yaml is not None else problems
    ds = deepspeed_config(data, file)
    if ds is not None:
        return None, [ds]
    return recipe_from_data(data, file, problems)


def recipe_from_data(data: Any, file: str = "", problems: list | None = None) -> tuple[Recipe | None, list[Problem]]:
    """A dict -> (Recipe, problems) after the schema; ``None`` when the schema rejects it."""
    problems = list(problems or []) + [p.with_file(file) for p in schema_problems(data)]
    if any(p.is_error for p in problems):
        return None, problems
    return Recipe.from_dict(data, source=file), problems
