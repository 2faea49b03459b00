"""Optional packages a test needs: skipped where missing, unless the run says the package must be there.

``PLUGIN_REQUIRE=accelerate,transformers pytest ...``: tests/conftest.py stops the run at once when a listed
package is not installed, and a dist module that needs one takes it through :func:`need`, which imports it
outright, so a package that is installed but broken is a collection error that fails the run too, instead of
a skip that passes it (a CI venv that lost accelerate would otherwise skip the whole native/Accelerate parity
suite and stay green). Unit tests' own ``importorskip`` calls are covered by the conftest check only.
"""
from __future__ import annotations

import importlib
import os

import pytest


def required() -> set[str]:
    return {name.strip() for name in os.environ.get("PLUGIN_REQUIRE", "").split(",") if name.strip()}


def need(name: str):
    """``import name``: a skip where it is missing, an ImportError (a failed run) where PLUGIN_REQUIRE lists it."""
    if name in required():
        return importlib.import_module(name)
    return pytest.importorskip(name)
