"""Process groups on 8 gloo processes: tp2 x pp2 x dp2 membership equals the topology's lists, every group
communicates, the mpu answers agree with the coordinates, and DeepSpeed's own pipeline grid wraps into
the same groups.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from .spawn import run

pytestmark = pytest.mark.dist

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def check_groups(groups, topology, rank):
    coord = topology.coord(rank)
    for axis, group, ranks in (("tensor", groups.tensor_group, groups.tensor_ranks),
                               ("data", groups.data_group, groups.data_ranks),
                               ("pipeline", groups.pipeline_group, groups.pipeline_ranks),
                               ("model", groups.model_group, groups.model_ranks)):
        assert list(ranks) == topology.group_of(rank, axis), (axis, ranks)
        assert dist.get_process_group_ranks(group) == list(ranks), (axis, dist.get_process_group_ranks(group))
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=group)
        assert total.item() == sum(ranks), (axis, total.item(), ranks)
    assert (groups.tp_rank, groups.dp_rank, groups.pp_rank) == (coord.tp, coord.dp, coord.pp)
    assert groups.get_tensor_model_parallel_rank() == coord.tp == dist.get_rank(groups.tensor_group)
    assert groups.get_tensor_model_parallel_world_size() == topology.tp_size
    assert groups.get_tensor_model_parallel_src_rank() == topology.rank(coord.pp, coord.dp, 0)
    assert groups.get_data_parallel_rank() == coord.dp == dist.get_rank(groups.data_group)
    assert groups.get_data_parallel_world_size() == topology.dp_size
    assert groups.get_data_parallel_group_ranks() == topology.group_of(rank, "data")
    assert groups.get_pipe_parallel_rank() == coord.pp == groups.get_pipeline_model_parallel_rank()
    assert groups.get_pipe_parallel_world_size() == topology.pp_size
    assert groups.get_model_parallel_world_size() == topology.tp_size * topology.pp_size
    assert groups.get_model_parallel_rank() == dist.get_rank(groups.model_group)


def groups_worker(rank, world_size, with_deepspeed):
    from plugin.distributed.groups import ParallelGroups, build_groups
    from plugin.distributed.topology import Topology

    topology = Topology(pp_size=2, dp_size=2, tp_size=2)
    check_groups(build_groups(topology), topology, rank)
    # no pipeline: the model group is the tensor group itself; a whole-world group is the default group
    flat = build_groups(Topology(dp_size=1, tp_size=8))
    assert flat.model_group is flat.tensor_group is dist.group.WORLD
    assert flat.get_model_parallel_rank() == flat.get_tensor_model_parallel_rank() == rank
    if with_deepspeed:
        import deepspeed
        from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

        deepspeed.init_distributed(dist_backend="gloo")
        grid = PipelineParallelGrid(topology=PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2))
        check_groups(ParallelGroups.from_deepspeed_grid(grid), topology, rank)
    return "ok"


def test_groups_tp2_pp2_dp2_on_8_processes_equal_the_topology():
    assert run(groups_worker, 8, HAS_DEEPSPEED) == ["ok"] * 8
