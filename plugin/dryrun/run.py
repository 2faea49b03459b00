"""``dry_run(recipe, ...)``: the ranks chosen, each simulated in turn (:mod:`.simulate`), then the checks."""
from __future__ import annotations

import time

from ..distributed.topology import Topology
from ..errors import PluginError, RecipeError
from .checks import run_checks
from .ranks import default_ranks, verify_ranks


def with_earlier_stages(ranks: list[int], topology: Topology) -> list[int]:
    """``ranks`` and, for a rank of a later pipeline stage, a rank of each earlier stage at the same tensor and context
    place when none is among them (a stage's simulation takes its input shapes from the stage before it, the same in
    every data replica); in rank order, stage by stage.

    >>> with_earlier_stages([7], Topology(pp_size=2, dp_size=2, tp_size=2))
    [3, 7]
    >>> with_earlier_stages([1, 7], Topology(pp_size=2, dp_size=2, tp_size=2))
    [1, 7]
    """
    out = set(ranks)
    places = {(c.pp, c.tp, c.cp) for c in map(topology.coord, ranks)}
    for r in ranks:
        c = topology.coord(r)
        for p in range(c.pp):
            if (p, c.tp, c.cp) not in places:
                out.add(topology.rank(pp=p, dp=c.dp, tp=c.tp, cp=c.cp))
                places.add((p, c.tp, c.cp))
    return sorted(out)


def dry_run(recipe, *, model: str = "gpt", world_size: int | None = None, ranks: list[int] | None = None,
            verify: bool = False, progress=None) -> dict:
    """Simulate ``ranks`` (default :func:`plugin.dryrun.ranks.default_ranks`; with ``verify`` also one whole group of
    each axis) of ``recipe`` at ``world_size``; the result (:mod:`.report` prints it)."""
    from .simulate import make_cache, simulate_rank
    from .stages import MissingStage

    layout = recipe.layout(world_size)
    topology = Topology.from_layout(layout)
    world = topology.world_size
    chosen = list(ranks) if ranks is not None else default_ranks(topology)
    if verify:
        chosen = sorted(set(chosen) | set(verify_ranks(topology)))
    chosen = with_earlier_stages(chosen, topology)
    start = time.perf_counter()
    cache = make_cache(recipe, model, world)
    reports, waiting = {}, list(chosen)
    while waiting:
        # Interleaved schedules: rank 0's virtual stage 2 takes its input shapes from rank 1's stage 1, whose own stage
        # 3 takes them from rank 0's stage 2. A rank whose stage finds no shapes yet is simulated again after the
        # others, which recorded theirs (each stage sends its shapes at its first forward, before it waits).
        deferred, known = [], len(cache.stages.forward)
        for rank in waiting:
            try:
                reports[rank] = simulate_rank(recipe, model, world, rank, cache)
            except MissingStage:
                deferred.append(rank)
                continue
            except RecipeError:
                raise  # the recipe against the model: the same on every rank, said with its JSON paths
            except PluginError as e:
                c = topology.coord(rank)
                raise PluginError(f"rank {rank} (pipeline {c.pp}, data {c.dp}, context {c.cp}, tensor {c.tp}): "
                                  f"{e}") from e
            if progress:
                progress(len(reports), len(chosen), rank)
        if deferred and len(cache.stages.forward) == known:  # a pass that recorded no shapes: they will never come
            raise PluginError(f"ranks {deferred}: their pipeline stages wait for input shapes that no simulated stage "
                              "sends -> dry-run them with --ranks all")
        waiting = deferred
    reports = [reports[r] for r in chosen]
    seconds = time.perf_counter() - start
    gpu = recipe.cluster.gpu_memory_gb if recipe.cluster is not None else None
    return {"recipe": recipe.name, "world_size": world, "model": model, "zero": recipe.zero.stage,
            "layout": {"tensor": layout.tensor, "pipeline": layout.pipeline, "data": layout.data,
                       "context": layout.context, "micro_batch": layout.micro_batch, "grad_accum": layout.grad_accum},
            "model_parameters": cache.model_count, "seconds": round(seconds, 2),
            "seconds_per_rank": round(seconds / len(reports), 3),
            "checks": run_checks(reports, topology, cache.model_count, gpu), "ranks": reports}
