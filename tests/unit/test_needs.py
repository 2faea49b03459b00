"""PLUGIN_REQUIRE turns a missing optional package from a skip (the run passes) into an error (it fails)."""
import pytest

from tests.dist.needs import need

pytestmark = pytest.mark.nods  # also without deepspeed: PLUGIN_REQUIRE where deepspeed is missing

MISSING = "plugin_no_such_package_h5"


def test_missing_package_skips_by_default(monkeypatch):
    monkeypatch.delenv("PLUGIN_REQUIRE", raising=False)
    with pytest.raises(pytest.skip.Exception):
        need(MISSING)


def test_missing_required_package_fails(monkeypatch):
    monkeypatch.setenv("PLUGIN_REQUIRE", f"accelerate, {MISSING}")
    with pytest.raises(ModuleNotFoundError):
        need(MISSING)
    assert need("json").__name__ == "json", "a present package is simply imported"


def test_what_plugin_require_can_name():
    from tests.dist.needs import unavailable
    from tests.dist.slurm_cluster import unavailable as slurm

    assert unavailable("json") is None and unavailable(MISSING) == "not installed"
    assert unavailable("slurm") == slurm()  # Slurm's daemons and commands, not a package
