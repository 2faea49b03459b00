"""Pure rank arithmetic, up to 4096 ranks, and equal to DeepSpeed's PipeModelDataParallelTopology."""
import itertools

import pytest

from plugin.distributed.topology import Coord, Topology

SHAPES = [(1, 1, 1), (1, 8, 1), (2, 2, 2), (4, 2, 1), (1, 2, 4), (3, 5, 2), (8, 64, 8), (16, 32, 8), (4, 128, 8),
          (2, 256, 8)]


@pytest.mark.parametrize("pp,dp,tp", SHAPES)
def test_coordinates_are_a_bijection_in_the_documented_order(pp, dp, tp):
    t = Topology(pp, dp, tp)
    assert t.world_size == pp * dp * tp
    seen = set()
    for rank in range(t.world_size):
        c = t.coord(rank)
        assert rank == (c.pp * dp + c.dp) * tp + c.tp
        assert t.rank(*c) == rank
        seen.add(c)
    assert len(seen) == t.world_size


@pytest.mark.parametrize("pp,dp,tp", SHAPES)
def test_groups_partition_the_world(pp, dp, tp):
    t = Topology(pp, dp, tp)
    for groups, size, count in ((t.tensor_groups(), tp, pp * dp), (t.data_groups(), dp, pp * tp),
                                (t.pipeline_groups(), pp, dp * tp), (t.model_groups(), pp * tp, dp)):
        assert len(groups) == count and all(len(g) == size for g in groups)
        flat = sorted(itertools.chain.from_iterable(groups))
        assert flat == list(range(t.world_size))


def test_groups_vary_along_one_axis_only():
    t = Topology(4, 8, 4)
    for g in t.tensor_groups():
        assert len({t.coord(r)[:2] for r in g}) == 1
        assert g == list(range(g[0], g[0] + 4)), "tensor peers are consecutive ranks"
    for g in t.data_groups():
        assert len({(t.coord(r).pp, t.coord(r).tp) for r in g}) == 1
    for g in t.pipeline_groups():
        assert [t.coord(r).pp for r in g] == list(range(4)), "pipeline groups are in stage order"


def test_known_layout_tp2_pp2_dp2():
    t = Topology(pp_size=2, dp_size=2, tp_size=2)
    assert t.coord(5) == Coord(pp=1, dp=0, tp=1)
    assert t.tensor_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.data_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.pipeline_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.group_of(6, "data") == [4, 6]


def test_node_placement():
    t = Topology(1, 4, 8)
    assert not t.tensor_groups_cross_nodes(8)
    assert t.tensor_groups_cross_nodes(4)
    assert Topology(1, 8, 2).tensor_groups_cross_nodes(8) is False
    assert Topology(1, 2, 3).tensor_groups_cross_nodes(4) is True


def test_bad_input():
    with pytest.raises(ValueError, match="pp_size"):
        Topology(0, 1, 1)
    with pytest.raises(ValueError, match="outside"):
        Topology(1, 2, 2).coord(4)
    with pytest.raises(ValueError, match="unknown axis"):
        Topology(1, 2, 2).group_of(0, "expert")


def test_from_recipe():
    from plugin.recipe.checks import load_recipe

    t = Topology.from_recipe(load_recipe("tp2_auto"), world_size=8)
    assert (t.pp_size, t.dp_size, t.tp_size) == (1, 4, 2)


@pytest.mark.parametrize("pp,dp,tp", [(2, 2, 2), (1, 4, 2), (4, 2, 1), (2, 3, 4), (8, 16, 8), (4, 64, 8),
                                      (1, 4096, 1), (16, 32, 8)])
def test_equals_deepspeed_pipe_model_data_parallel_topology(pp, dp, tp):
    ds = pytest.importorskip("deepspeed.runtime.pipe.topology")
    theirs = ds.PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    ours = Topology(pp, dp, tp)
    assert theirs.world_size() == ours.world_size
    for rank in range(ours.world_size):
        c = theirs.get_coord(rank)
        assert (c.pipe, c.data, c.model) == tuple(ours.coord(rank))
    assert sorted(theirs.get_axis_comm_lists("model")) == sorted(ours.tensor_groups())
    assert sorted(theirs.get_axis_comm_lists("data")) == sorted(ours.data_groups())
    assert sorted(theirs.get_axis_comm_lists("pipe")) == sorted(ours.pipeline_groups())
