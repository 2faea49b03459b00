"""Where the schemas and shipped recipes are: inside the installed package, or beside it in a checkout."""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent.parent  # plugin/, the package this module's room sits in


def data_dir(kind: str) -> Path:
    """``schemas`` or ``recipes``: ``plugin/<kind>`` in a wheel, ``<repo>/<kind>`` in a source checkout."""
    for candidate in (_PACKAGE / kind, _PACKAGE.parent / kind):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"the plugin's {kind}/ folder is missing (looked in {_PACKAGE / kind} and {_PACKAGE.parent / kind}); "
        "reinstall the package with `pip install .`"
    )


def schema_path() -> Path:
    return data_dir("schemas") / "recipe.schema.json"


def recipes_dir() -> Path:
    return data_dir("recipes")
