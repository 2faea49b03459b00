"""parallel-recipe: one validated JSON recipe for data, tensor and pipeline parallelism.

``import plugin`` is cheap: the pure parts (recipe, checks, topology, estimates, config export) load on
first use and never import torch; the engines load lazily too.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> module that defines it; resolved on first attribute access (PEP 562).
_LAZY = {
    "Recipe": "recipe.spec",
    "read_recipe": "recipe.load",
    "find_recipe": "recipe.load",
    "shipped_recipes": "recipe.load",
    "RecipeError": "errors",
    "Problem": "errors",
    "PluginError": "errors",
    "Topology": "distributed.topology",
    "Layout": "recipe.layout",
    "check_recipe": "recipe.checks",
    "load_recipe": "recipe.checks",
    "validate": "recipe.checks",
    "initialize": "engines.initialize",
    "Engine": "engines.base",
    "apply_tensor_parallel": "tensor_parallel.plan",
    "build_groups": "distributed.groups",
}

__all__ = sorted(_LAZY)


def lazy_attributes(package: str, table: dict[str, str], namespace: dict):
    """A package's module ``__getattr__`` (PEP 562): ``name`` from its submodule ``table[name]`` (relative to
    ``package``), imported on first use and kept in ``namespace`` (the package's globals)."""
    def get(name: str):
        if name in table:
            value = getattr(importlib.import_module(f".{table[name]}", package), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return get


__getattr__ = lazy_attributes(__name__, _LAZY, globals())


def __dir__():
    return sorted(list(globals()) + __all__)
