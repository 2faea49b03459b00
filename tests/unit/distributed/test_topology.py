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
        Topology(1, 2, 2).group_of(0, "experts")


def test_from_recipe():
    from plugin.recipe.checks import load_recipe

    t = Topology.from_recipe(load_recipe("tp2_auto"), world_size=8)
    assert (t.pp_size, t.dp_size, t.tp_size, t.cp_size) == (1, 4, 2, 1)


@pytest.mark.parametrize("pp,dp,tp", [(2, 2, 2), (1, 4, 2), (4, 2, 1), (2, 3, 4), (8, 16, 8), (4, 64, 8),
                                      (1, 4096, 1), (16, 32, 8)])
def test_equals_deepspeed_pipe_model_data_parallel_topology(pp, dp, tp):
    ds = pytest.importorskip("deepspeed.runtime.pipe.topology")
    theirs = ds.PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    ours = Topology(pp, dp, tp)
    assert theirs.world_size() == ours.world_size
    for rank in range(ours.world_size):
        c = theirs.get_coord(rank)
        assert Coord(c.pipe, c.data, c.model) == ours.coord(rank)
    assert sorted(theirs.get_axis_comm_lists("model")) == sorted(ours.tensor_groups())
    assert sorted(theirs.get_axis_comm_lists("data")) == sorted(ours.data_groups())
    assert sorted(theirs.get_axis_comm_lists("pipe")) == sorted(ours.pipeline_groups())


CP_SHAPES = [(1, 1, 1, 2), (1, 2, 1, 4), (2, 2, 2, 2), (1, 3, 4, 2), (4, 8, 8, 4), (2, 16, 8, 8)]


@pytest.mark.parametrize("pp,dp,tp,cp", CP_SHAPES)
def test_context_axis_sits_between_tensor_and_data(pp, dp, tp, cp):
    """Megatron's order tp-cp-dp-pp: rank = ((pp x D + dp) x C + cp) x T + tp; every group partitions the world and
    varies along its own axes only; without a context axis nothing moves."""
    t = Topology(pp, dp, tp, cp)
    assert t.world_size == pp * dp * tp * cp
    for rank in range(t.world_size):
        c = t.coord(rank)
        assert rank == ((c.pp * dp + c.dp) * cp + c.cp) * tp + c.tp
        assert t.rank(*c) == rank
    for lists, size, axes in ((t.context_groups(), cp, {"cp"}), (t.data_groups(), dp, {"dp"}),
                              (t.data_context_groups(), dp * cp, {"dp", "cp"}),
                              (t.model_groups(), pp * tp, {"pp", "tp"}),
                              (t.replica_groups(), pp * cp * tp, {"pp", "cp", "tp"}), (t.tensor_groups(), tp, {"tp"})):
        assert all(len(g) == size for g in lists)
        assert sorted(itertools.chain.from_iterable(lists)) == list(range(t.world_size))
        fixed = [f for f in Coord._fields if f not in axes]
        for g in lists:
            assert len({tuple(getattr(t.coord(r), f) for f in fixed) for r in g}) == 1
    flat = Topology(pp, dp * cp, tp)  # data x context as one axis is the three-axis grid's data axis
    assert t.data_context_groups() == flat.data_groups()


@pytest.mark.parametrize("pp,dp,tp,cp", CP_SHAPES)
def test_context_order_equals_megatron_rank_generator(pp, dp, tp, cp):
    ps = pytest.importorskip("megatron.core.parallel_state")
    gen = ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    t = Topology(pp, dp, tp, cp)
    for theirs, ours in (("tp", t.tensor_groups()), ("cp", t.context_groups()), ("dp", t.data_groups()),
                         ("dp-cp", t.data_context_groups()), ("pp", t.pipeline_groups()), ("tp-pp", t.model_groups())):
        assert sorted(gen.get_ranks(theirs)) == sorted(ours), theirs
