"""Session checks shared by tests/unit and tests/dist.

``PLUGIN_REQUIRE=deepspeed,accelerate,transformers pytest``: every listed package must import, or the run
stops at once with the reason. Without it, tests that need an optional package skip where it is missing;
with it (the README's test commands, so CI), a venv that lost a package fails instead of skipping its
suites and staying green. :func:`tests.dist.needs.need` applies the same rule inside a module.
"""
import importlib

import pytest

from tests.dist.needs import required


def pytest_sessionstart(session):
    missing = []
    for name in sorted(required()):
        try:
            importlib.import_module(name)
        except Exception as e:  # an ImportError, or a package that is there but broken
            missing.append(f"{name} ({type(e).__name__}: {e})")
    if missing:
        raise pytest.UsageError(f"PLUGIN_REQUIRE lists packages this environment cannot import: "
                                f"{', '.join(missing)} -> install them, or drop them from PLUGIN_REQUIRE")
