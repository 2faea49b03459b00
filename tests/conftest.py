"""Session checks shared by tests/unit and tests/dist.

``PLUGIN_REQUIRE=deepspeed,accelerate,transformers pytest``: every listed package must be installed, or the
run stops at once with the reason (looked up, not imported: importing deepspeed here would pick its
accelerator before any test sets DS_ACCELERATOR). Without it, tests that need an optional package skip where it is
missing; with it (the README's test commands, so CI), a venv that lost a package fails instead of skipping its
suites and staying green. :func:`tests.dist.needs.need` applies the same rule inside a module. ``slurm`` in the
list is Slurm's daemons and commands (:func:`tests.dist.needs.unavailable`): the Slurm tests then fail where it cannot
run instead of skipping.
"""
import pytest

from tests.dist.needs import required, unavailable


def pytest_sessionstart(session):
    missing = [name for name in sorted(required()) if unavailable(name)]
    if missing:
        raise pytest.UsageError(f"PLUGIN_REQUIRE lists what cannot be had here: "
                                f"{', '.join(f'{name} ({unavailable(name)})' for name in missing)} "
                                "-> install them, or drop them from PLUGIN_REQUIRE")
