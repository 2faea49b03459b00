"""Pure rank arithmetic: which rank holds which (pipeline, data, context, tensor) coordinate.

One rank order, Megatron-LM's (``RankGenerator`` with order ``tp-cp-ep-dp-pp``), which is DeepSpeed's
``PipeModelDataParallelTopology`` (axes pipe, data, model) whenever there is no context axis: tensor fastest,
then context, then data, then pipeline::

    rank = ((pp_rank * dp_size + dp_rank) * cp_size + cp_rank) * tp_size + tp_rank

Tensor-parallel peers therefore sit on consecutive ranks (inside one node whenever ``tp_size`` divides
the GPUs per node), which is where their two all-reduces per block want to be; context peers (who pass keys and
values around a ring in every attention) come next. On 8 ranks of pipeline 2 x data 2 x tensor 2:

>>> t = Topology(pp_size=2, dp_size=2, tp_size=2)
>>> t.coord(5)
Coord(pp=1, dp=0, tp=1, cp=0)
>>> t.rank(pp=1, dp=0, tp=1)
5
>>> t.tensor_groups()
[[0, 1], [2, 3], [4, 5], [6, 7]]

With a context axis of 2 (data 2 x tensor 2 x context 2), context peers are ``tp_size`` apart, and gradients are
reduced over data x context (every rank holding the same parameters):

>>> t = Topology(dp_size=2, tp_size=2, cp_size=2)
>>> t.coord(6)
Coord(pp=0, dp=1, tp=0, cp=1)
>>> t.context_groups(), t.data_groups()
([[0, 2], [1, 3], [4, 6], [5, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
>>> t.data_context_groups()
[[0, 2, 4, 6], [1, 3, 5, 7]]

An expert axis (``ep_size`` E) is carved out of the ranks of one pipeline stage, as Megatron-LM's expert
``RankGenerator`` (order ``tp-ep-dp-pp`` with the expert tensor degree) and torchtitan (EP borrowed from data x context)
do, so the world is unchanged: inside a stage, a rank's place is ``(edp * E + ep) * etp + etp_rank``, ``etp``
the tensor ranks each expert is split over (``etp_size``: the tensor degree by default, 1 for whole experts). With
``etp`` equal to the tensor degree, expert peers are consecutive data x context coordinates; the expert-data group
(the ranks holding the same experts, over which their gradients are reduced) is data x context / E. On data 4 x
tensor 2 with E 2:

>>> t = Topology(dp_size=4, tp_size=2, ep_size=2)
>>> t.expert_groups()
[[0, 2], [1, 3], [4, 6], [5, 7]]
>>> t.expert_data_groups()
[[0, 4], [1, 5], [2, 6], [3, 7]]

Nothing here touches torch.distributed: :mod:`plugin.distributed.groups` turns these rank lists into process
groups. The examples are doctests (tests/unit/test_doctests.py runs them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Coord(NamedTuple):
    """A rank's place on the four axes. The field order keeps ``Coord(pp, dp, tp)`` of the three-axis grid (``cp``
    last, 0 by default); the rank order is tensor, context, data, pipeline (fastest first)."""

    pp: int
    dp: int
    tp: int
    cp: int = 0


@dataclass(frozen=True)
class Topology:
    """The (pipeline, data, context, tensor) grid of a job. ``world_size = pp_size * dp_size * cp_size * tp_size``.
    ``ep_size`` experts' ranks are carved out of each stage's ranks, each expert split over ``etp_size`` tensor ranks
    (``None``: ``tp_size``); ``ep_size x etp_size`` must divide ``dp_size x cp_size x tp_size``."""

    pp_size: int = 1
    dp_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    etp_size: int | None = None

    def __post_init__(self) -> None:
        if self.etp_size is None:
            object.__setattr__(self, "etp_size", self.tp_size)
        for name in ("pp_size", "dp_size", "tp_size", "cp_size", "ep_size", "etp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Topology.{name} must be an int >= 1, got {value!r}")
        if self.stage_size % (self.ep_size * self.etp_size):
            raise ValueError(f"expert {self.ep_size} x expert tensor {self.etp_size} does not divide the "
                             f"{self.stage_size} ranks of a pipeline stage (data x context x tensor)")

    @classmethod
    def from_recipe(cls, recipe, world_size: int | None = None) -> Topology:
        """The grid of a recipe; ``"data": "auto"`` needs ``world_size`` to be resolved."""
        return cls.from_layout(recipe.layout(world_size))

    @classmethod
    def from_layout(cls, layout) -> Topology:
        """The grid of a resolved :class:`plugin.recipe.layout.Layout`."""
        return cls(pp_size=layout.pipeline, dp_size=layout.data, tp_size=layout.tensor, cp_size=layout.context,
                   ep_size=getattr(layout, "expert", 1), etp_size=getattr(layout, "expert_tensor", None))

    @property
    def world_size(self) -> int:
        return self.pp_size * self.dp_size * self.cp_size * self.tp_size

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage: data x context x tensor."""
        return self.dp_size * self.cp_size * self.tp_size

    @property
    def edp_size(self) -> int:
        """The expert-data degree: ranks holding the same experts (the same expert-tensor slice), stage / (E x etp)."""
        return self.stage_size // (self.ep_size * self.etp_size)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} ranks")

    def coord(self, rank: int) -> Coord:
        """(pp, dp, tp, cp) of ``rank``: tensor fastest, then context, then data, pipeline slowest.

        >>> Topology(pp_size=2, dp_size=3, tp_size=4).coord(13)
        Coord(pp=1, dp=0, tp=1, cp=0)
        >>> Topology(dp_size=2, tp_size=2, cp_size=2).coord(3)
        Coord(pp=0, dp=0, tp=1, cp=1)
        >>> Topology(dp_size=4).coord(4)
        Traceback (most recent call last):
        ...
        ValueError: rank 4 is outside a world of 4 ranks
        """
        self._check_rank(rank)
        tp = rank % self.tp_size
        cp = (rank // self.tp_size) % self.cp_size
        dp = (rank // (self.tp_size * self.cp_size)) % self.dp_size
        pp = rank // (self.tp_size * self.cp_size * self.dp_size)
        return Coord(pp, dp, tp, cp)

    def rank(self, pp: int = 0, dp: int = 0, tp: int = 0, cp: int = 0) -> int:
        """The rank at a coordinate, the inverse of :meth:`coord`.

        >>> t = Topology(pp_size=2, dp_size=3, tp_size=4, cp_size=2)
        >>> t.rank(pp=1, dp=0, tp=1, cp=1)
        29
        >>> all(t.rank(*t.coord(r)) == r for r in range(t.world_size))
        True
        """
        if not (0 <= pp < self.pp_size and 0 <= dp < self.dp_size and 0 <= tp < self.tp_size
                and 0 <= cp < self.cp_size):
            raise ValueError(f"coordinate (pp={pp}, dp={dp}, tp={tp}, cp={cp}) is outside {self}")
        return ((pp * self.dp_size + dp) * self.cp_size + cp) * self.tp_size + tp

    def _lists(self, inner: str) -> list[list[int]]:
        """Rank lists: the ranks that differ only along the axes in ``inner`` (letters p, d, c, t, slowest first),
        one list per coordinate of the other axes, in rank order of their first rank."""
        sizes = {"p": self.pp_size, "d": self.dp_size, "c": self.cp_size, "t": self.tp_size}
        outer = [a for a in "pdct" if a not in inner]

        def coords(axes):
            out = [{}]
            for a in axes:
                out = [{**c, a: i} for c in out for i in range(sizes[a])]
            return out

        def rank_of(c):
            return self.rank(pp=c.get("p", 0), dp=c.get("d", 0), tp=c.get("t", 0), cp=c.get("c", 0))

        return [[rank_of({**o, **i}) for i in coords(inner)] for o in coords(outer)]

    # Group rank lists: every list holds the ranks that differ only along one axis (or a few).
    def tensor_groups(self) -> list[list[int]]:
        """Ranks sharing (pp, dp, cp): the tensor-parallel groups, consecutive ranks.

        >>> Topology(pp_size=2, dp_size=2, tp_size=2).tensor_groups()
        [[0, 1], [2, 3], [4, 5], [6, 7]]
        """
        return self._lists("t")

    def context_groups(self) -> list[list[int]]:
        """Ranks sharing (pp, dp, tp): the context-parallel groups (each holds its chunks of the same rows' sequence;
        keys and values go around them), ``tp_size`` apart.

        >>> Topology(dp_size=2, tp_size=2, cp_size=2).context_groups()
        [[0, 2], [1, 3], [4, 6], [5, 7]]
        """
        return self._lists("c")

    def data_groups(self) -> list[list[int]]:
        """Ranks sharing (pp, cp, tp): the data-parallel groups (each member trains other rows), ``cp_size x tp_size``
        apart.

        >>> Topology(pp_size=2, dp_size=2, tp_size=2).data_groups()
        [[0, 2], [1, 3], [4, 6], [5, 7]]
        """
        return self._lists("d")

    def data_context_groups(self) -> list[list[int]]:
        """Ranks sharing (pp, tp): data x context, every rank holding the same parameters, over which gradients are
        reduced (Megatron's data-parallel group "with context parallel", DeepSpeed's sequence-data-parallel group);
        the data groups when ``cp_size`` is 1.

        >>> Topology(pp_size=2, dp_size=2, tp_size=2, cp_size=2).data_context_groups()
        [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
        """
        return self._lists("dc")

    def pipeline_groups(self) -> list[list[int]]:
        """Ranks sharing (dp, cp, tp): one pipeline each, in stage order, ``dp_size x cp_size x tp_size`` apart.

        >>> Topology(pp_size=2, dp_size=2, tp_size=2).pipeline_groups()
        [[0, 4], [1, 5], [2, 6], [3, 7]]
        """
        return self._lists("p")

    def model_groups(self) -> list[list[int]]:
        """Ranks sharing (dp, cp): tensor x pipeline, what Megatron calls "model parallel" (one model replica; its
        ranks hold every parameter once, so a gradient norm sums over it).

        >>> Topology(pp_size=2, dp_size=2, tp_size=2).model_groups()
        [[0, 1, 4, 5], [2, 3, 6, 7]]
        """
        return self._lists("pt")

    def replica_groups(self) -> list[list[int]]:
        """Ranks sharing dp: tensor x context x pipeline, the ranks given the same rows of a global batch (one list
        per data rank); the model groups when ``cp_size`` is 1.

        >>> Topology(dp_size=2, tp_size=2, cp_size=2).replica_groups()
        [[0, 1, 2, 3], [4, 5, 6, 7]]
        """
        return self._lists("pct")

    # -- the expert axis (carved out of a stage's ranks, Megatron's expert RankGenerator)
    def expert_coord(self, rank: int) -> tuple[int, int, int]:
        """(expert-data rank, expert rank, expert-tensor rank) of ``rank`` inside its stage.

        >>> Topology(dp_size=4, tp_size=2, ep_size=2).expert_coord(6)
        (1, 1, 0)
        >>> Topology(dp_size=4, tp_size=2, ep_size=4, etp_size=1).expert_coord(6)
        (1, 2, 0)
        """
        self._check_rank(rank)
        local = rank % self.stage_size
        etp = local % self.etp_size
        ep = (local // self.etp_size) % self.ep_size
        return local // (self.etp_size * self.ep_size), ep, etp

    def _expert_lists(self, axis: str) -> list[list[int]]:
        """Rank lists varying only the expert coordinate ``axis`` ("ep", "edp" or "etp"), in rank order of their first
        rank."""
        sizes = {"edp": self.edp_size, "ep": self.ep_size, "etp": self.etp_size}
        others = [a for a in ("edp", "ep", "etp") if a != axis]
        out = []
        for pp in range(self.pp_size):
            for a in range(sizes[others[0]]):
                for b in range(sizes[others[1]]):
                    c = {others[0]: a, others[1]: b}
                    out.append([pp * self.stage_size + ((c.get("edp", i if axis == "edp" else 0) * self.ep_size
                                                         + c.get("ep", i if axis == "ep" else 0)) * self.etp_size
                                                        + c.get("etp", i if axis == "etp" else 0))
                                for i in range(sizes[axis])])
        return sorted(out)

    def expert_groups(self) -> list[list[int]]:
        """Ranks holding different experts of the same layers, between which tokens are sent (all-to-all): E of them,
        ``etp_size`` apart (the tensor degree by default: consecutive data x context coordinates).

        >>> Topology(dp_size=2, cp_size=2, tp_size=2, ep_size=2).expert_groups()
        [[0, 2], [1, 3], [4, 6], [5, 7]]
        >>> Topology(dp_size=4, tp_size=2, ep_size=4, etp_size=1).expert_groups()
        [[0, 1, 2, 3], [4, 5, 6, 7]]
        """
        return self._expert_lists("ep")

    def expert_data_groups(self) -> list[list[int]]:
        """Ranks holding the same experts (and expert-tensor slice): the experts' gradients are reduced over them;
        data x context / E of them with the default expert tensor degree.

        >>> Topology(pp_size=2, dp_size=4, ep_size=2).expert_data_groups()
        [[0, 2], [1, 3], [4, 6], [5, 7]]
        >>> Topology(dp_size=4, ep_size=4).expert_data_groups()
        [[0], [1], [2], [3]]
        """
        return self._expert_lists("edp")

    def expert_tensor_groups(self) -> list[list[int]]:
        """Ranks splitting the same experts by columns and rows: the tensor groups by default, single ranks for whole
        experts.

        >>> Topology(dp_size=2, tp_size=2, ep_size=2).expert_tensor_groups()
        [[0, 1], [2, 3]]
        >>> Topology(dp_size=2, tp_size=2, ep_size=2, etp_size=1).expert_tensor_groups()
        [[0], [1], [2], [3]]
        """
        return self._expert_lists("etp")

    AXES = ("tensor", "context", "data", "data_context", "pipeline", "model", "replica", "expert", "expert_data",
            "expert_tensor")

    def group_of(self, rank: int, axis: str) -> list[int]:
        """The ``axis`` group (one of :attr:`AXES`) that holds ``rank``.

        >>> t = Topology(pp_size=2, dp_size=2, tp_size=2)
        >>> t.group_of(5, "data"), t.group_of(5, "pipeline"), t.group_of(5, "model")
        ([5, 7], [1, 5], [0, 1, 4, 5])
        """
        if axis not in self.AXES:
            raise ValueError(f"unknown axis {axis!r}; use one of {sorted(self.AXES)}")
        self._check_rank(rank)
        return next(g for g in getattr(self, f"{axis}_groups")() if rank in g)

    @staticmethod
    def node_of(rank: int, gpus_per_node: int) -> int:
        """The node a rank lands on when launchers fill nodes with consecutive ranks.

        >>> Topology.node_of(5, gpus_per_node=4)
        1
        """
        return rank // gpus_per_node

    def _cross_nodes(self, lists: list[list[int]], gpus_per_node: int) -> bool:
        return any(len({self.node_of(r, gpus_per_node) for r in g}) > 1 for g in lists)

    def tensor_groups_cross_nodes(self, gpus_per_node: int) -> bool:
        """True when some tensor group spans more than one node.

        >>> Topology(dp_size=2, tp_size=4).tensor_groups_cross_nodes(gpus_per_node=8)
        False
        >>> Topology(dp_size=2, tp_size=4).tensor_groups_cross_nodes(gpus_per_node=2)
        True
        """
        return self._cross_nodes(self.tensor_groups(), gpus_per_node)

    def context_groups_cross_nodes(self, gpus_per_node: int) -> bool:
        """True when some context group spans more than one node (its ring then runs over the inter-node network).

        >>> Topology(dp_size=2, tp_size=2, cp_size=2).context_groups_cross_nodes(gpus_per_node=4)
        False
        >>> Topology(tp_size=4, cp_size=2).context_groups_cross_nodes(gpus_per_node=4)
        True
        """
        return self._cross_nodes(self.context_groups(), gpus_per_node)
