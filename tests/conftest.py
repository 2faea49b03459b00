"""Session checks shared by tests/unit and tests/dist.

``PLUGIN_REQUIRE=deepspeed,accelerate,transformers pytest``: every listed package must be installed, or the
run stops at once with the reason (looked up, not imported: importing deepspeed here would pick its
accelerator before any test sets DS_ACCELERATOR). Without it, tests that need an optional package skip where it is
missing; with it (the README's test commands, so CI), a venv that lost a package fails instead of skipping its
suites and staying green. :func:`tests.dist.needs.need` applies the same rule inside a module. ``slurm`` in the
list is Slurm's daemons and commands (:func:`tests.dist.needs.unavailable`): the Slurm tests then fail where it cannot
run instead of skipping.
"""
import os

import pytest

from tests.dist.needs import required, unavailable


def pytest_sessionstart(session):
    missing = [name for name in sorted(required()) if unavailable(name)]
    if missing:
        raise pytest.UsageError(f"PLUGIN_REQUIRE lists what cannot be had here: "
                                f"{', '.join(f'{name} ({unavailable(name)})' for name in missing)} "
                                "-> install them, or drop them from PLUGIN_REQUIRE")


# DeepSpeed compiles its CPU shared-memory all-reduce op (csrc/cpu/comm/shm.cpp) the first time a process starts its
# comm on a machine: 37 s of wall time here (64 s of CPU), charged to whichever DeepSpeed test comes first (a worker
# held that long). Here it starts with the session, beside the unit tests (testpaths in pyproject.toml puts them
# first), which start no DeepSpeed comm; a DeepSpeed start that comes before it is done waits on the build's lock
# (torch's FileBaton) and then loads the result. A session that ends sooner waits for it (a fresh machine only). The
# build runs in a session of its own and is never killed (a build killed half-way leaves that lock behind, and every
# later DeepSpeed start waits on it forever).
_SHM_OP_BUILD = """
from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder("ShareMemCommBuilder").load()
"""


def _deepspeed_shm_op_built() -> bool:
    import sys
    from pathlib import Path

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
    return (Path(root) / tag / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").exists()


def pytest_configure(config):
    import importlib.util
    import subprocess
    import sys

    if (os.environ.get("PYTEST_XDIST_WORKER") or importlib.util.find_spec("deepspeed") is None
            or _deepspeed_shm_op_built() or config.option.collectonly):
        return
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    config._plugin_shm_op_build = subprocess.Popen(  # noqa: SLF001 - this conftest's own attribute
        [sys.executable, "-c", _SHM_OP_BUILD], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)


def pytest_unconfigure(config):
    build = getattr(config, "_plugin_shm_op_build", None)
    if build is not None:
        build.wait()  # never killed (above)
