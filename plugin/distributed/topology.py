"""Pure rank arithmetic: which rank holds which (pipeline, data, tensor) coordinate.

One rank order, the one DeepSpeed (``PipeModelDataParallelTopology``, axes pipe, data, model) and
Megatron-LM use: tensor fastest, then data, then pipeline::

    rank = (pp_rank * dp_size + dp_rank) * tp_size + tp_rank

Tensor-parallel peers therefore sit on consecutive ranks (inside one node whenever ``tp_size`` divides
the GPUs per node), which is where their two all-reduces per block want to be. On 8 ranks of pipeline 2 x
data 2 x tensor 2:

>>> t = Topology(pp_size=2, dp_size=2, tp_size=2)
>>> t.coord(5)
Coord(pp=1, dp=0, tp=1)
>>> t.rank(pp=1, dp=0, tp=1)
5
>>> t.tensor_groups()
[[0, 1], [2, 3], [4, 5], [6, 7]]

Nothing here touches torch.distributed: :mod:`plugin.distributed.groups` turns these rank lists into process
groups. The examples are doctests (tests/unit/test_doctests.py runs them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Coord(NamedTuple):
    """A rank's place on the three axes."""

    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class Topology:
    """The (pipeline, data, tensor) grid of a job. ``world_size = pp_size * dp_size * tp_size``."""

    pp_size: int = 1
    dp_size: int = 1
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("pp_size", "dp_size", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Topology.{name} must be an int >= 1, got {value!r}")

    @classmethod
    def from_recipe(cls, recipe, world_size: int | None = None) -> Topology:
        """The grid of a recipe; ``"data": "auto"`` needs ``world_size`` to be resolved."""
        layout = recipe.layout(world_size)
        return cls(pp_size=layout.pipeline, dp_size=layout.data, tp_size=layout.tensor)

    @property
    def world_size(self) -> int:
        return self.pp_size * self.dp_size * self.tp_size

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} ranks")

    def coord(self, rank: int) -> Coord:
        """(pp, dp, tp) of ``rank``: tensor fastest, pipeline slowest.

        >>> Topology(pp_size=2, dp_size=3, tp_size=4).coord(13)
        Coord(pp=1, dp=0, tp=1)
        >>> Topology(dp_size=4).coord(4)
        Traceback (most recent call last):
        ...
        ValueError: rank 4 is outside a world of 4 ranks
        """
        self._check_rank(rank)
        tp = rank % self.tp_size
        dp = (rank // self.tp_size) % self.dp_size
        pp = rank // (self.tp_size * self.dp_size)
        return Coord(pp, dp, tp)

    def rank(self, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        """The rank at a coordinate, the inverse of :meth:`coord`.

        >>> t = Topology(pp_size=2, dp_size=3, tp_size=4)
        >>> t.rank(pp=1, dp=0, tp=1)
        13
        >>> all(t.rank(*t.coord(r)) == r for r in range(t.world_size))
        True
        """
        if not (0 <= pp < self.pp_size and 0 <= dp < self.dp_size and 0 <= tp < self.tp_size):
            raise ValueError(f"coordinate (pp={pp}, dp={dp}, tp={tp}) is outside {self}")
        return (pp * self.dp_size + dp) * self.tp_size + tp

    # Group rank lists: every list holds the ranks that differ only along one axis (or two).
    def tensor_groups(self) -> list[list[int]]:
        """Ranks sharing (pp, dp): the tensor-parallel groups, consecutive ranks.

        >>> Topology(pp_size=2, dp_size=2, tp_size=2).tensor_groups()
        [[0, 1], [2, 3], [4, 5], [6, 7]]
        """
        return [[self.rank(p, d, t) for t in range(self.tp_size)]
                for p in range(self.pp_size) for d in range(self.dp_size)]

    def data_groups(self) -> list[list[int]]:
        """Ranks sharing (pp, tp): the data-parallel groups (gradients are averaged over these), ``tp_size`` apart.

        >>> Topology(pp_size=2, dp_size=2, tp_size=2).data_groups()
        [[0, 2], [1, 3], [4, 6], [5, 7]]
        """
        return [[self.rank(p, d, t) for d in range(self.dp_size)]
                for p in range(self.pp_size) for t in range(self.tp_size)]

    def pipeline_groups(self) -> list[list[int]]:
        """Ranks sharing (dp, tp): one pipeline each, in stage order, ``dp_size x tp_size`` apart.

        >>> Topology(pp_size=2, dp_size=2, tp_size=2).pipeline_groups()
        [[0, 4], [1, 5], [2, 6], [3, 7]]
        """
        return [[self.rank(p, d, t) for p in range(self.pp_size)]
                for d in range(self.dp_size) for t in range(self.tp_size)]

    def model_groups(self) -> list[list[int]]:
        """Ranks sharing dp: tensor x pipeline, what Megatron calls "model parallel" (one model replica).

        >>> Topology(pp_size=2, dp_size=2, tp_size=2).model_groups()
        [[0, 1, 4, 5], [2, 3, 6, 7]]
        """
        return [[self.rank(p, d, t) for p in range(self.pp_size) for t in range(self.tp_size)]
                for d in range(self.dp_size)]

    def group_of(self, rank: int, axis: str) -> list[int]:
        """The ``axis`` ("tensor", "data", "pipeline" or "model") group that holds ``rank``.

        >>> t = Topology(pp_size=2, dp_size=2, tp_size=2)
        >>> t.group_of(5, "data"), t.group_of(5, "pipeline"), t.group_of(5, "model")
        ([5, 7], [1, 5], [0, 1, 4, 5])
        """
        lists = {
            "tensor": self.tensor_groups,
            "data": self.data_groups,
            "pipeline": self.pipeline_groups,
            "model": self.model_groups,
        }
        if axis not in lists:
            raise ValueError(f"unknown axis {axis!r}; use one of {sorted(lists)}")
        self._check_rank(rank)
        return next(g for g in lists[axis]() if rank in g)

    @staticmethod
    def node_of(rank: int, gpus_per_node: int) -> int:
        """The node a rank lands on when launchers fill nodes with consecutive ranks.

        >>> Topology.node_of(5, gpus_per_node=4)
        1
        """
        return rank // gpus_per_node

    def tensor_groups_cross_nodes(self, gpus_per_node: int) -> bool:
        """True when some tensor group spans more than one node.

        >>> Topology(dp_size=2, tp_size=4).tensor_groups_cross_nodes(gpus_per_node=8)
        False
        >>> Topology(dp_size=2, tp_size=4).tensor_groups_cross_nodes(gpus_per_node=2)
        True
        """
        return any(len({self.node_of(r, gpus_per_node) for r in g}) > 1 for g in self.tensor_groups())
