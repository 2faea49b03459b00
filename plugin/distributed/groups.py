"""Process groups from the pure topology: the only module that calls ``torch.distributed.new_group``.

:func:`build_groups` turns :class:`plugin.distributed.topology.Topology`'s rank lists into process groups and returns
this rank's :class:`ParallelGroups`; :func:`build_tie_groups` makes the groups over which the copies of a weight
tied across pipeline stages sum their gradients (the native back end's; DeepSpeed's PipelineModule builds its own).
``new_group`` must be called by every rank for every group in the same order; it is, in the topology's order:
tensor, data, pipeline, model, then (with a context axis) context and data x context groups, then (with an expert
axis) the expert, expert-data and expert-tensor groups. A rank list seen before
reuses its group (with no pipeline the model group is the tensor group), and a group of the whole world is the default
group itself, so no communicator is created twice.

With DeepSpeed's ``PipelineModule`` the groups already exist in its grid (``deepspeed.initialize`` then
requires ``mpu=None``): :meth:`ParallelGroups.from_deepspeed_grid` wraps them without creating any, so
the tensor-parallel layers and the pipeline engine use one and the same tensor group.

The plugin's own code reads the fields (``tensor_group``, ``data_group``, ``pipeline_group``, ``model_group``,
their ``*_ranks``) and the coordinates (``tp_rank``, ``dp_size``, ...). The ``get_*`` methods are an adapter,
kept only because DeepSpeed calls them: a :class:`ParallelGroups` is a DeepSpeed ``mpu``,
``deepspeed.initialize(model, mpu=groups, ...)``.
DeepSpeed's "model parallel" group is the model group (tensor x pipeline), which is the tensor group
when there is no pipeline, the case in which DeepSpeed takes an external mpu; it sums gradient norms
over that group, counting a replicated parameter on tensor rank 0 only and a parameter with
``tensor_model_parallel = True`` (what the tensor-parallel layers set) on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..errors import PluginError
from .topology import Topology


class GroupError(PluginError):
    """Process groups cannot be built as asked (the message says what to change)."""


@dataclass(frozen=True, eq=False)
class ParallelGroups:
    """This rank's tensor, data, pipeline and model (tensor x pipeline) groups, and their rank lists; with a context
    axis also its context group (the ranks holding the other chunks of the same rows) and its data x context group,
    over which gradients are reduced (every rank holding the same parameters). Without one, ``context_group`` is
    None and ``data_context_group`` is the data group."""

    topology: Topology
    rank: int
    tensor_group: Any
    tensor_ranks: tuple[int, ...]
    data_group: Any
    data_ranks: tuple[int, ...]
    pipeline_group: Any
    pipeline_ranks: tuple[int, ...]
    model_group: Any
    model_ranks: tuple[int, ...]
    context_group: Any = None
    context_ranks: tuple[int, ...] = ()
    data_context_group: Any = None
    data_context_ranks: tuple[int, ...] = ()
    expert_group: Any = None
    expert_ranks: tuple[int, ...] = ()
    expert_data_group: Any = None
    expert_data_ranks: tuple[int, ...] = ()
    expert_tensor_group: Any = None
    expert_tensor_ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.context_ranks:  # no context axis: a context of one, gradients over the data group
            object.__setattr__(self, "context_ranks", (self.rank,))
            object.__setattr__(self, "data_context_group", self.data_group)
            object.__setattr__(self, "data_context_ranks", self.data_ranks)
        if not self.expert_ranks:  # no expert axis: every expert here, their gradients over data x context
            object.__setattr__(self, "expert_ranks", (self.rank,))
            object.__setattr__(self, "expert_data_group", self.data_context_group)
            object.__setattr__(self, "expert_data_ranks", self.data_context_ranks)
            object.__setattr__(self, "expert_tensor_group", self.tensor_group)
            object.__setattr__(self, "expert_tensor_ranks", self.tensor_ranks)

    @property
    def ep_size(self) -> int:
        """Ranks the experts of a layer are placed over (1: every expert on every rank)."""
        return len(self.expert_ranks)

    @property
    def ep_rank(self) -> int:
        return self.expert_ranks.index(self.rank)

    @property
    def edp_size(self) -> int:
        """Ranks holding the same experts, over which their gradients are reduced."""
        return len(self.expert_data_ranks)

    # -- coordinates
    @property
    def tp_size(self) -> int:
        return len(self.tensor_ranks)

    @property
    def tp_rank(self) -> int:
        return self.tensor_ranks.index(self.rank)

    @property
    def dp_size(self) -> int:
        return len(self.data_ranks)

    @property
    def dp_rank(self) -> int:
        return self.data_ranks.index(self.rank)

    @property
    def pp_size(self) -> int:
        return len(self.pipeline_ranks)

    @property
    def pp_rank(self) -> int:
        return self.pipeline_ranks.index(self.rank)

    @property
    def cp_size(self) -> int:
        return len(self.context_ranks)

    @property
    def cp_rank(self) -> int:
        return self.context_ranks.index(self.rank)

    @property
    def data_context_size(self) -> int:
        """Ranks over which gradients are reduced: data x context."""
        return len(self.data_context_ranks)

    @property
    def model_size(self) -> int:
        """Ranks of one model replica: tensor x pipeline."""
        return len(self.model_ranks)

    @classmethod
    def from_deepspeed_grid(cls, grid, context: int = 1, timeout: timedelta | None = None) -> ParallelGroups:
        """Wrap the groups of a DeepSpeed ``PipelineParallelGrid`` (``pipeline_module._grid``).

        The grid must use the plugin's rank order (``PipeModelDataParallelTopology`` or
        ``PipeDataParallelTopology``: axes pipe, data[, model]); its slice group is the tensor group. With a context
        axis (``context`` > 1) the grid's data axis is data x context, context fastest as in the plugin's order
        (``PipeModelDataParallelTopology(num_dp=data * context)``): its data group is every rank holding the same
        stage, over which the pipeline engine reduces gradients. The context groups and the data groups proper are
        then created here, by every rank in the same order (``timeout`` as :func:`build_groups`'); without a context
        axis nothing is created.
        """
        topo = grid.topology()
        axes = list(topo.get_axis_names())
        if axes not in (["pipe", "data"], ["pipe", "data", "model"]):
            raise GroupError(f"DeepSpeed grid with axes {axes}: the plugin's rank order is pipe, data, model "
                             f"(tensor fastest); build the PipelineModule with PipeModelDataParallelTopology")
        replicas = topo.get_dim("data")
        if replicas % context:
            raise GroupError(f"DeepSpeed grid with {replicas} data ranks cannot hold context {context}: build its "
                             f"topology with num_dp = data x context")
        topology = Topology(pp_size=topo.get_dim("pipe"), dp_size=replicas // context,
                            tp_size=topo.get_dim("model") if "model" in axes else 1, cp_size=context)
        rank = grid.get_global_rank()
        model_ranks = tuple(sorted(topo.get_axis_list(axis="data", idx=grid.get_data_parallel_rank())))
        tensor = grid.get_slice_parallel_group(), tuple(grid.slice_group)
        replicas_group = grid.get_data_parallel_group(), tuple(grid.get_data_parallel_group_ranks())
        pipeline = grid.get_pipe_parallel_group(), tuple(grid.pp_group)
        model = grid.get_model_parallel_group(), model_ranks
        if context == 1:
            groups = cls(topology, rank, *tensor, *replicas_group, *pipeline, *model)
        else:
            made = {}
            for axis in ("data", "context"):  # every rank creates every group, in the topology's order
                for ranks in getattr(topology, f"{axis}_groups")():
                    group = dist.new_group(ranks, timeout=timeout)
                    if rank in ranks:
                        made[axis] = group, tuple(ranks)
            groups = cls(topology, rank, *tensor, *made["data"], *pipeline, *model, *made["context"], *replicas_group)
        expected = {"tensor": groups.tensor_ranks, "data": groups.data_ranks, "pipeline": groups.pipeline_ranks,
                    "model": groups.model_ranks, "data_context": groups.data_context_ranks}
        wrong = {axis: ranks for axis, ranks in expected.items() if list(ranks) != topology.group_of(rank, axis)}
        if wrong:
            raise GroupError(f"DeepSpeed grid groups {wrong} differ from the plugin's topology {topology} at rank "
                             f"{rank}; build the PipelineModule's topology as PipeModelDataParallelTopology("
                             f"num_pp={topology.pp_size}, num_mp={topology.tp_size}, "
                             f"num_dp={topology.dp_size * topology.cp_size})")
        return groups

    # ------------------------------------------------------------------------------------------------------------
    # Adapter: the DeepSpeed / Megatron ``mpu`` protocol, in DeepSpeed's words ("model parallel" = tensor x pipeline,
    # "slice" and "tensor model parallel" = tensor, "pipe" = pipeline). Only DeepSpeed calls these (it is handed
    # the groups as ``deepspeed.initialize(mpu=...)``); the plugin reads the fields and coordinates above.
    # ------------------------------------------------------------------------------------------------------------
    def get_global_rank(self) -> int:
        return self.rank

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_tensor_model_parallel_group(self):
        return self.tensor_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of tensor rank 0 in this rank's tensor group."""
        return self.tensor_ranks[0]

    # DeepSpeed's pipeline grid calls the tensor axis "slice".
    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size
    get_slice_parallel_group = get_tensor_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp_size

    def get_data_parallel_group(self):
        return self.data_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.data_ranks)

    def get_pipe_parallel_rank(self) -> int:
        return self.pp_rank

    def get_pipe_parallel_world_size(self) -> int:
        return self.pp_size

    def get_pipe_parallel_group(self):
        return self.pipeline_group

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_group = get_pipe_parallel_group

    def get_model_parallel_rank(self) -> int:
        """Rank in the model group (tensor x pipeline); the tensor rank when there is no pipeline."""
        return self.model_ranks.index(self.rank)

    def get_model_parallel_world_size(self) -> int:
        return len(self.model_ranks)

    def get_model_parallel_group(self):
        return self.model_group

    # DeepSpeed's sequence parallelism is the context axis: with these, its engine reduces (ZeRO: partitions)
    # gradients over the sequence-data-parallel group (data x context) and divides their sum by the data degree
    # alone, while its batch accounting (train_batch_size = micro x grad_accum x data) counts data ranks only.
    # Without a context axis they name a context of one and the data group: DeepSpeed behaves as it did.
    def get_sequence_parallel_rank(self) -> int:
        return self.cp_rank

    def get_sequence_parallel_world_size(self) -> int:
        return self.cp_size

    def get_sequence_parallel_group(self):
        return self.context_group  # None without a context axis (DeepSpeed asks only when its size > 1)

    def get_sequence_data_parallel_rank(self) -> int:
        return self.data_context_ranks.index(self.rank)

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.data_context_size

    def get_sequence_data_parallel_group(self):
        return self.data_context_group


def build_groups(topology: Topology, backend: str | None = None, timeout: timedelta | None = None) -> ParallelGroups:
    """Create every tensor, data, pipeline and model group of ``topology`` (and context and data x context groups
    when it has a context axis); return this rank's.

    A collective: every rank of the default group must call it with the same topology. ``backend``
    (e.g. "gloo" next to an NCCL default group) is passed to ``new_group``; ``None`` uses the default's.
    ``timeout``: how long a collective on these groups may wait (the recipe's ``watchdog``; ``None``: torch's
    ``new_group`` default, 30 min on gloo and 10 on NCCL, not the default group's).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise GroupError("torch.distributed is not initialized: call torch.distributed.init_process_group "
                         "(or deepspeed.init_distributed) before build_groups, or run under a launcher "
                         "(torchrun, deepspeed, accelerate launch)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if topology.world_size != world:
        raise GroupError(f"the topology {topology} needs {topology.world_size} processes but "
                         f"{world} were launched; launch {topology.world_size}, or change the recipe's "
                         f"parallelism so that pipeline x data x tensor x context = {world}")
    made: dict[tuple[int, ...], Any] = {}

    def group_for(lists: list[list[int]]):
        mine = None
        for ranks in lists:
            key = tuple(ranks)
            if key not in made:
                # the default group already spans the world: reuse it rather than open a second communicator
                whole_world = key == tuple(range(world)) and backend is None
                made[key] = dist.group.WORLD if whole_world else dist.new_group(list(key), backend=backend,
                                                                                timeout=timeout)
            if rank in key:
                mine = key
        assert mine is not None, (rank, lists)
        return made[mine], mine

    tensor = group_for(topology.tensor_groups())
    data = group_for(topology.data_groups())
    pipeline = group_for(topology.pipeline_groups())
    model = group_for(topology.model_groups())
    more = {}
    if topology.cp_size > 1:
        more.update(zip(("context_group", "context_ranks"), group_for(topology.context_groups()), strict=True))
        more.update(zip(("data_context_group", "data_context_ranks"), group_for(topology.data_context_groups()),
                        strict=True))
    if topology.ep_size > 1:  # carved out of data x context: the expert, expert-data and expert-tensor groups
        for axis in ("expert", "expert_data", "expert_tensor"):
            more.update(zip((f"{axis}_group", f"{axis}_ranks"), group_for(getattr(topology, f"{axis}_groups")()),
                            strict=True))
    return ParallelGroups(topology, rank, *tensor, *data, *pipeline, *model, **more)


def build_tie_groups(topology: Topology, pipeline_ranks: list[tuple[int, ...]], backend: str | None = None,
                     timeout: timedelta | None = None) -> dict:
    """Megatron's embedding group, for any weight tied across pipeline stages: for each set of pipeline coordinates
    in ``pipeline_ranks`` (e.g. ``(0, pipeline - 1)``: the first and last stage), one group per (data, context, tensor)
    coordinate of the global ranks at those pipeline coordinates. Returns ``{pipeline ranks: this rank's group}``
    for the sets this rank is in (gradients of the tied copies are summed over it).

    A collective: every rank calls it with the same sets, in the same order (the sets are sorted here). ``timeout``:
    as :func:`build_groups`'.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = {}
    for pp_ranks in sorted(set(pipeline_ranks)):
        for dp in range(topology.dp_size):
            for cp in range(topology.cp_size):
                for tp in range(topology.tp_size):
                    ranks = [topology.rank(pp=p, dp=dp, tp=tp, cp=cp) for p in pp_ranks]
                    whole_world = len(ranks) == world and backend is None
                    group = dist.group.WORLD if whole_world else dist.new_group(ranks, backend=backend, timeout=timeout)
                    if rank in ranks:
                        mine[pp_ranks] = group
    return mine
