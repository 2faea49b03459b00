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


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'plugin' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
