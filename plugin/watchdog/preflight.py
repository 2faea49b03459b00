"""Before step 1: every rank runs the same recipe at the same layout, and every group completes one small
all-reduce in time.

1. :func:`agree_on_layout`, as soon as the world's group exists (before the back end makes any other): one
   all-gather of 5 int64 per rank (pipeline, data, tensor and a digest of the recipe). Ranks launched with another
   recipe or layout would build other groups than their peers, and wait in them until the timeout: here every rank
   refuses at once (a :class:`~plugin.errors.RecipeError`, rank 0 prints it), naming the ranks, layouts and hosts.
2. :func:`check_groups`, once the engine exists: for every group this rank is in (the plugin's tensor, data,
   pipeline, model and tie groups, and those DeepSpeed, FSDP2 or a pipeline schedule made: whatever torch holds),
   one all-reduce of ``[1, digest of its ranks]``. The world first, within ``timeout_s`` (every rank finishing its
   build), then the others in one order every rank shares (by their ranks, then torch's name), each within
   ``min(timeout_s, 60)``. A group that does not complete, or whose members disagree on who is in it, stops the job
   through the guard's report (:meth:`plugin.watchdog.guard.Guard.stall`), naming the group, its ranks and hosts.
"""
from __future__ import annotations

import json
import sys
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import Problem, RecipeError
from . import collectives
from .ledger import group_kind, group_words
from .verdict import hosts_words, layout_disagreement


def _digest(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def _wait(work, seconds: float) -> bool:
    try:
        work.wait(timeout=timedelta(seconds=seconds))
        return True
    except RuntimeError:  # gloo: "Operation timed out!"; the work itself goes on
        return False


def _ledgers(guard, ranks) -> dict:
    out = {}
    for r in ranks:
        if guard.store.check([f"ledger/{r}"]):
            out[r] = json.loads(guard.store.get(f"ledger/{r}"))
    return out


def agree_on_layout(guard, device) -> None:
    """Pre-flight 1 (see the module); raises :class:`PluginError` on every rank when the ranks disagree."""
    lay = guard.recipe.layout(guard.world)
    recipe = _digest(json.dumps(guard.recipe.to_dict(), sort_keys=True))
    mine = torch.tensor([lay.pipeline, lay.data, lay.tensor, recipe, 0], dtype=torch.int64, device=device)
    rows = [torch.zeros_like(mine) for _ in range(guard.world)]
    guard.ledger.enter("preflight", "every rank's recipe and layout")
    work = dist.all_gather(rows, mine, async_op=True)
    if not _wait(work, guard.timeout_s):
        guard.stall(f"pre-flight: the world group did not complete an all-gather within {guard.timeout_s:g} s")
    got = [tuple(int(v) for v in t.tolist()[:4]) for t in rows]
    if len(set(got)) > 1:
        hosts = {r: e["host"] for r, e in _ledgers(guard, range(guard.world)).items()}
        problem = Problem("$.parallelism", layout_disagreement(got, hosts),
                          "launch every rank with the same recipe (the same --recipe file on every node)")
        if guard.rank == 0:
            print(problem.with_file(guard.recipe.source).format(), file=sys.stderr, flush=True)
        raise RecipeError([problem])
    if guard.server is not None:  # everyone has read the store's address by now (join, before this)
        dist.distributed_c10d._get_default_store().delete_key("plugin-watchdog/store")


def check_groups(guard, device) -> None:
    """Pre-flight 2 (see the module): returns when every group of this rank completed its all-reduce."""
    groups = collectives.groups_of_this_rank()
    world = [(n, g) for n, g in groups.items() if len(g[1]) == guard.world]
    others = sorted(((n, g) for n, g in groups.items() if 1 < len(g[1]) < guard.world),
                    key=lambda item: (item[1][1], int(item[0]) if item[0].isdigit() else 1 << 30, item[0]))
    for i, (_name, (pg, ranks)) in enumerate(world[:1] + others):
        window = guard.timeout_s if i == 0 and world else guard.recipe.watchdog.preflight_s
        words = group_words(group_kind(guard.topology, ranks), ranks)
        guard.ledger.enter("preflight", words)
        value = _digest(",".join(map(str, ranks)))
        t = torch.tensor([1, value], dtype=torch.int64, device=device)
        if not _wait(dist.all_reduce(t, group=pg, async_op=True), window):
            hosts = hosts_words(_ledgers(guard, ranks), ranks) or "unknown"
            guard.stall(f"pre-flight: {words} did not complete an all-reduce within {window:g} s (hosts {hosts})")
        if t.tolist() != [len(ranks), len(ranks) * value]:
            guard.stall(f"pre-flight: the members of {words} disagree on who is in it (sum {t.tolist()}, expected "
                        f"{[len(ranks), len(ranks) * value]}: launched with other layouts?)")
