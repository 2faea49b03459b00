"""The expert axis's rank math (plugin/distributed/topology.py) against an independent construction, up to thousands
of ranks: Megatron's expert RankGenerator (order tp-ep-dp-pp with the expert tensor degree) written as a reshape of
the rank range, every group list a partition of the world, and the default expert tensor degree carving E out of
data x context (each expert group and each expert-data group inside one data x context group)."""
from __future__ import annotations

import itertools

import pytest

from plugin.distributed.topology import Topology

pytestmark = pytest.mark.nods


def _megatron(pp, stage, ep, etp, axis):
    """Rank lists of ``axis`` from the rank grid [pp][edp][ep][etp] (fastest last), one per other coordinate."""
    edp = stage // (ep * etp)
    sizes = {"pp": pp, "edp": edp, "ep": ep, "etp": etp}
    order = ["pp", "edp", "ep", "etp"]

    def rank(c):
        r = 0
        for a in order:
            r = r * sizes[a] + c[a]
        return r

    others = [a for a in order if a != axis]
    out = []
    for values in itertools.product(*(range(sizes[a]) for a in others)):
        c = dict(zip(others, values, strict=True))
        out.append([rank({**c, axis: i}) for i in range(sizes[axis])])
    return sorted(out)


def _layouts(limit):
    for pp, dp, cp, tp in itertools.product((1, 2, 4), (1, 2, 4, 8, 16, 64), (1, 2, 4), (1, 2, 8)):
        for ep in (1, 2, 4, 8, 16):
            for etp in {tp, 1}:
                if (dp * cp * tp) % (ep * etp) == 0 and pp * dp * cp * tp <= limit:
                    yield pp, dp, cp, tp, ep, etp


def test_expert_groups_match_megatrons_rank_generator_up_to_thousands_of_ranks():
    seen = 0
    for pp, dp, cp, tp, ep, etp in _layouts(4096):
        t = Topology(pp_size=pp, dp_size=dp, cp_size=cp, tp_size=tp, ep_size=ep, etp_size=etp)
        stage = dp * cp * tp
        assert t.expert_groups() == _megatron(pp, stage, ep, etp, "ep")
        assert t.expert_data_groups() == _megatron(pp, stage, ep, etp, "edp")
        assert t.expert_tensor_groups() == _megatron(pp, stage, ep, etp, "etp")
        for lists in (t.expert_groups(), t.expert_data_groups(), t.expert_tensor_groups()):
            assert sorted(r for g in lists for r in g) == list(range(t.world_size))  # a partition of the world
        assert t.edp_size * ep * etp == stage
        seen += 1
    assert seen > 300


@pytest.mark.parametrize("pp, dp, cp, tp, ep", [(1, 8, 1, 1, 2), (2, 4, 2, 2, 4), (4, 64, 2, 8, 16), (1, 512, 1, 8, 8)])
def test_default_expert_tensor_carves_the_experts_out_of_data_x_context(pp, dp, cp, tp, ep):
    t = Topology(pp_size=pp, dp_size=dp, cp_size=cp, tp_size=tp, ep_size=ep)
    assert t.expert_tensor_groups() == t.tensor_groups()
    def of(lists):
        return {r: g for g in lists for r in g}

    dc, ex, exd = of(t.data_context_groups()), of(t.expert_groups()), of(t.expert_data_groups())
    assert t.group_of(t.world_size - 1, "expert") == ex[t.world_size - 1]
    for r in range(t.world_size):
        experts, expert_data = ex[r], exd[r]
        assert set(experts) <= set(dc[r]) and set(expert_data) <= set(dc[r])
        assert len(experts) == ep and len(expert_data) == dp * cp // ep
        assert set(experts) & set(expert_data) == {r}
        edp, e, etp = t.expert_coord(r)
        assert (e, etp) == (experts.index(r), t.coord(r).tp) and edp == expert_data.index(r)


def test_an_expert_axis_that_does_not_divide_the_stage_is_refused():
    with pytest.raises(ValueError, match="expert 3 x expert tensor 2 does not divide the 8 ranks"):
        Topology(dp_size=4, tp_size=2, ep_size=3)


def test_from_layout_reads_the_expert_degree():
    from plugin.recipe.layout import Layout

    layout = Layout(data=4, tensor=2, pipeline=1, global_batch=8, micro_batch=2, grad_accum=1, expert=2,
                    expert_tensor=1)
    t = Topology.from_layout(layout)
    assert (t.ep_size, t.etp_size, t.edp_size) == (2, 1, 4)
    assert layout.words == "data 4 x tensor 2 x pipeline 1 (expert 2 of data x context, whole experts)"
