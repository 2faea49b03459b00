"""The examples in the pure modules' docstrings run as doctests: the rank math (as DeepSpeed's
runtime/pipe/topology.py shows its own), the cut of layers into stages, byte sizes for people."""
import doctest
import importlib

import pytest

MODULES = ["plugin.distributed.topology", "plugin.pipeline_parallel.stages", "plugin.planning.units",
           "plugin.materialize.seeds", "plugin.recipe.elastic", "plugin.recipe.layout",
           "plugin.context_parallel.chunks", "plugin.watchdog.settings", "plugin.watchdog.ledger",
           "plugin.watchdog.verdict", "plugin.dryrun.ranks", "plugin.dryrun.run"]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no doctest examples"
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctest examples of {name} failed (run -v)"
