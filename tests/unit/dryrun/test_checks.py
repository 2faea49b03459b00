"""The dry run's pure parts: rank lists and the checks, on reports written by hand (no torch)."""
import pytest

from plugin.distributed.topology import Topology
from plugin.dryrun.checks import check_collectives, check_groups, check_memory, check_parameters, check_pipeline
from plugin.dryrun.ranks import compress, default_ranks, expand, parse_ranks, verify_ranks
from plugin.errors import PluginError


def test_rank_lists_round_trip_at_scale():
    t = Topology(pp_size=8, dp_size=16, tp_size=8)
    for axis in t.AXES:
        for rank in (0, 5, 777, 1023):
            group = t.group_of(rank, axis)
            assert expand(compress(group)) == group
    assert compress(t.group_of(0, "pipeline")) == "0,128,...,896"
    assert compress(t.group_of(0, "tensor")) == "0-7"
    assert len(default_ranks(t)) == 65 and default_ranks(t)[-1] == 1023
    assert {0, 1023} <= set(verify_ranks(t))


def test_parse_ranks_names_what_is_wrong():
    assert parse_ranks("all", 4) == [0, 1, 2, 3]
    with pytest.raises(PluginError, match="outside the world of 4"):
        parse_ranks("2-5", 4)
    with pytest.raises(PluginError, match="not a rank"):
        parse_ranks("x", 4)


def _report(t, rank, params=10, calls=(), seq=None, groups=None, total=100):
    return {"rank": rank, "coordinates": dict(zip(("pipeline", "data", "tensor", "context"), t.coord(rank),
                                                 strict=True)),
            "groups": groups or {a: compress(t.group_of(rank, a)) for a in ("tensor", "data", "pipeline")},
            "parameters": params, "parameters_counted": params, "bytes": {"total": total},
            "collectives": list(calls), "sequences": seq or {}}


def test_each_check_passes_on_agreeing_ranks_and_names_the_ranks_that_do_not():
    t = Topology(pp_size=2, tp_size=2)
    send = {"op": "send", "group": "pipeline", "bytes": 8, "count": 2, "peer": 2}
    recv = {"op": "recv", "group": "pipeline", "bytes": 8, "count": 2, "peer": 0}
    seq = {"0,1": [["all_reduce", 64]]}
    good = [_report(t, 0, calls=[send], seq=seq), _report(t, 1, seq=seq), _report(t, 2, calls=[recv]),
            _report(t, 3)]
    assert check_groups(good, t)["ok"] and check_pipeline(good)["ok"] and check_collectives(good)["ok"]
    assert check_parameters(good, t, 40)["ok"] and check_memory(good, 1.0)["ok"]
    # faults: a member of the tensor group sees another group, a receive missing, a collective one rank skips,
    # a parameter too many, a rank over its memory
    bad = [_report(t, 0, calls=[send], seq=seq), _report(t, 1, seq={"0,1": []}, groups={"tensor": "1,3"}),
           _report(t, 2, calls=[{**recv, "count": 1}]), _report(t, 3, params=11, total=2 * 10**9)]
    assert check_groups(bad, t)["ranks"] == [1]
    assert check_pipeline(bad)["ranks"] == [0, 2]
    assert check_collectives(bad)["ranks"] == [1]
    assert check_parameters(bad, t, 40)["ok"] is False
    assert check_memory(bad, 1.0)["ranks"] == [3]
    assert check_parameters(good[:2], t, 40)["ok"] is None  # stage 1 of replica 0 not simulated: said, not failed
