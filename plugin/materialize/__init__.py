"""Models built on the meta device, materialised on each rank as only what it holds (issue 12).

``capture(model)`` (:mod:`.units`) records, before any wrapping, what one init call fills (a *unit*: a module with
parameters or buffers of its own), a dense template of it and how it is filled; :func:`.run.materialize` then
makes each unit whole at its dense shape under a generator seeded by ``(seed, qualified name)``
(:func:`.seeds.unit_seed`), cuts this rank's piece from it (the tensor-parallel cut re-run on the dense twin) and
hands the piece to a back end's sink (:mod:`.sinks`: swap in, FSDP2 shard, DeepSpeed ZeRO-3 partition). The values
depend on the seed and the model only, never on the layout.
"""
from .run import init_in_place, materialize
from .seeds import unit_seed
from .units import capture

__all__ = ["capture", "init_in_place", "materialize", "unit_seed"]
