"""Optional packages a test needs: skipped where missing, unless the run says the package must be there.

``PLUGIN_REQUIRE=accelerate,transformers pytest ...``: tests/conftest.py stops the run at once when a listed
package is not installed, and a dist module that needs one takes it through :func:`need`, which imports it
outright, so a package that is installed but broken is a collection error that fails the run too, instead of
a skip that passes it (a CI venv that lost accelerate would otherwise skip the whole native/Accelerate parity
suite and stay green). Unit tests' own ``importorskip`` calls are covered by the conftest check only.

``slurm`` is not a package but Slurm's daemons and commands (:func:`tests.dist.slurm_cluster.unavailable`): listed,
the run stops at once where they cannot run, and the Slurm tests fail instead of skipping.
"""
from __future__ import annotations

import importlib
import importlib.util
import os

import pytest


def required() -> set[str]:
    return {name.strip() for name in os.environ.get("PLUGIN_REQUIRE", "").split(",") if name.strip()}


def unavailable(name: str) -> str | None:
    """Why a PLUGIN_REQUIRE name cannot be had here (None: it can): a package that is not installed, or for ``slurm``
    a Slurm that cannot run."""
    if name == "slurm":
        from .slurm_cluster import unavailable as slurm_unavailable

        return slurm_unavailable()
    return None if importlib.util.find_spec(name) is not None else "not installed"


def need(name: str):
    """``import name``: a skip where it is missing, an ImportError (a failed run) where PLUGIN_REQUIRE lists it."""
    if name in required():
        return importlib.import_module(name)
    return pytest.importorskip(name)
