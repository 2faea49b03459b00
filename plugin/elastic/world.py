"""Which processes train at this start of an elastic job, and which sit it out (pure: no torch).

torchrun's elastic agent (``--nnodes MIN:MAX``) restarts every worker on each membership change, with RANK and
WORLD_SIZE of the new world. An elastic recipe (:func:`plugin.recipe.elastic.elastic_problems`: ``"data": "auto"``,
``batch.global``) re-resolves its data degree from that world, but not every world fits: tensor x pipeline (x
context) must divide it and the global batch must split into micro x data. Then the largest usable number of
processes below it trains (:func:`plugin.recipe.elastic.usable_world`) and the surplus leave before any process group
exists: the launcher numbers ranks contiguously, so ranks ``0 .. usable-1`` train, and the training processes are
told ``WORLD_SIZE=usable`` before they build their groups. torch's default group is then made over them alone (its
store waits for ``usable`` processes), and the ones that left are never waited for. A node none of whose processes
train keeps its first one, standing by (:mod:`.standby`): without a worker left, torch's agent would leave the job.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import Problem, RecipeError
from ..recipe.elastic import elastic_problems, layout_at, usable_world

SHARED_STORE = "TORCHELASTIC_USE_AGENT_STORE"  # torchrun tells its workers whether they share its rendezvous store
NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # what an agent reads to stop sharing it


@dataclass(frozen=True)
class ElasticWorld:
    """This process at this start: its rank in the launched world (and on its node), the launched and the usable
    size, and the processes per node (torchrun numbers ranks node by node; launch.sh starts as many on each)."""

    rank: int
    launched: int
    usable: int
    layout: object  # plugin.recipe.layout.Layout at ``usable`` processes
    local_rank: int = 0
    per_node: int = 0  # LOCAL_WORLD_SIZE; 0 outside torchrun's agent (no node to keep in the job)

    @property
    def trains(self) -> bool:
        return self.rank < self.usable

    @property
    def surplus(self) -> range:
        return range(self.usable, self.launched)

    @property
    def stands_by(self) -> bool:
        """The first process of a node none of whose processes train: it stays (:mod:`.standby`), the rest exit."""
        return self.per_node > 0 and self.local_rank == 0 and not self.trains

    def sit_out_line(self, name: str) -> str:
        """The one line the first surplus process prints for all of them."""
        per_node = self.per_node or self.launched
        idle = idle_node_ranks(self.launched, self.usable, per_node)
        held = [str(r) for r in range(idle.start, idle.stop, per_node)]
        stay = "" if not held else (f"; rank {held[0]} stands by, its node trains none" if len(held) == 1 else
                                    f"; ranks {', '.join(held)} stand by, their nodes train none")
        first, last = self.surplus[0], self.surplus[-1]
        who = f"rank {first} sits" if first == last else f"ranks {first}-{last} sit"
        return (f"elastic: {who} out this start (exit 0 now, back at the next restart{stay}): {name} trains on "
                f"{self.usable} of the {self.launched} processes, {self.layout.words}, the most it can use")


def idle_node_ranks(launched: int, usable: int, per_node: int) -> range:
    """The ranks of the nodes none of whose processes train: ranks go node by node, ``per_node`` on each, and the
    first ``usable`` train.

    >>> idle_node_ranks(6, 4, 2), idle_node_ranks(6, 3, 2), idle_node_ranks(6, 4, 6)
    (range(4, 6), range(4, 6), range(6, 6))
    """
    first = -(-usable // per_node) * per_node
    return range(min(first, launched), launched)


def model_words(parallelism, numbers: bool = True) -> str:
    """``tensor T x pipeline P`` (`` x context C`` with a context axis): one replica of the model, the unit of an
    elastic world; ``numbers=False`` gives the words alone."""
    axes = [("tensor", parallelism.tensor), ("pipeline", parallelism.pipeline)]
    axes += [("context", parallelism.context)] if parallelism.context > 1 else []
    return " x ".join(f"{name} {n}" if numbers else name for name, n in axes)


def follow_world(recipe, environ: Mapping[str, str]) -> ElasticWorld:
    """This process's part in the world the launcher started (RANK, WORLD_SIZE; a world of one without them).

    Raises :class:`RecipeError` when the recipe cannot follow a changing world, or when not even one process of
    this world can train it (every process reaches the same verdict, before any process group)."""
    problems = elastic_problems(recipe)
    launched = int(environ.get("WORLD_SIZE", "1"))
    usable = None if problems else usable_world(recipe, launched)
    if not problems and usable is None:
        p = recipe.parallelism
        problems = [Problem("$.parallelism", f"no number of processes up to the {launched} launched can train the "
                            f"recipe ({model_words(p)}, batch.global {recipe.batch.global_}, micro "
                            f"{recipe.batch.micro})",
                            f"launch at least {model_words(p, numbers=False)} processes on a world where the global "
                            "batch splits",
                            file=str(recipe.source or ""))]
    if problems:
        raise RecipeError(problems)
    rank = int(environ.get("RANK", "0"))
    return ElasticWorld(rank, launched, usable, layout_at(recipe, usable), int(environ.get("LOCAL_RANK", rank)),
                        int(environ.get("LOCAL_WORLD_SIZE", "0")))


def shared_store_warning(environ: Mapping[str, str]) -> str | None:
    """A warning when torchrun shares its rendezvous store with the workers (torch's default since 2.4): with it,
    a node that joins a running job in a later round never finds the master address there and the job ends."""
    if environ.get(SHARED_STORE) != "True":
        return None
    return (f"elastic: warning: torchrun shares its rendezvous store with the workers ({SHARED_STORE}=True): a node "
            "that joins this job later waits for a master address no agent writes in that round (torch 2.13: "
            "'wait timeout ... torchelastic/role_info'), and the job ends -> export "
            f"{NO_SHARED_STORE}=1 for every torchrun agent of the job (launch.sh --elastic does)")
