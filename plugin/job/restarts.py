"""A job started again and again (pure: no torch): an elastic start's world, and ``--resume auto``'s heartbeat.

:func:`elastic_start`: before any process group, which processes of the world the launcher started train
(:func:`plugin.elastic.world.follow_world`): the surplus leave at once, the others are told the world that trains.
:class:`Restarts`: the run's ledger in ``--save`` (:class:`plugin.elastic.ledger.Heartbeat`), read before any process
group, counted at this start and beaten after every step, with the lines rank 0 prints about it.
"""
from __future__ import annotations

import time
from collections.abc import Callable, MutableMapping

from ..elastic.ledger import Heartbeat
from ..elastic.world import follow_world, shared_store_warning


def elastic_start(recipe, environ: MutableMapping[str, str], say: Callable[[str], None]):
    """This process's :class:`plugin.elastic.world.ElasticWorld` at this start of an elastic job (``train.py
    --elastic``), before any process group. ``.trains``: ``environ["WORLD_SIZE"]`` is now the world that trains
    (torch's group waits for those alone). Else this process is surplus: it exits 0, or stands by where its node
    trains none (``.stands_by``, :func:`plugin.elastic.standby.stand_by`); the first of the surplus ``say``s so for
    all of them.
    Raises :class:`~plugin.errors.RecipeError` when the recipe cannot follow the world (every process alike)."""
    world = follow_world(recipe, environ)
    if not world.trains:
        if world.rank == world.usable:
            say(world.sit_out_line(recipe.name))
        return world
    environ["WORLD_SIZE"] = str(world.usable)
    warning = shared_store_warning(environ)
    if warning and world.rank == 0:
        say(warning)
    return world


class Restarts:
    """``--resume auto``'s bookkeeping of the run in ``save``: its start number (``start``, for the metrics) and
    the recovery time of a restart (module docstring). Made before any process group: every rank reads the
    ledger before rank 0 rewrites it."""

    def __init__(self, save: str, environ: MutableMapping[str, str]):
        self.save = save
        self.heartbeat = Heartbeat(save, environ.get("TORCHELASTIC_RUN_ID", ""))
        self.restart_count = environ.get("TORCHELASTIC_RESTART_COUNT", "-")
        self.main = False

    @property
    def start(self) -> int:
        return self.heartbeat.start

    def begin(self, engine, step: int, resumed_from: str | None, say: Callable[[str], None]) -> None:
        """Count this start (rank 0 writes the ledger) once the engine exists; rank 0 ``say``s where it starts."""
        self.main = engine.is_main
        self.heartbeat.begin(self.main, engine.layout.data, engine.topology.world_size)
        if self.main:
            say(f"resume auto: start {self.start} of the run in {self.save} (torchrun restart {self.restart_count}): "
                + (f"from step {step} ({resumed_from})" if resumed_from else "no complete checkpoint there, a fresh "
                   "start"))

    def beat(self, step: int, say: Callable[[str], None]) -> None:
        """After training ``step``: rank 0 records it; on this start's first step of a restart, rank 0 ``say``s how
        long the recovery took."""
        recovered = self.heartbeat.beat(step, time.time())
        if recovered and self.main:
            say(recovered)
