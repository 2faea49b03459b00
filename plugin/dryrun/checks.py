"""What the simulated ranks must agree on, pure: each check a dict ``{"name", "ok", "detail", "ranks"}``, ``ok``
None when the ranks it needs were not simulated (then ``detail`` says which to add).

* ``groups``: every member of a group (that was simulated) has the same group for that axis, and it is the
  topology's.
* ``collectives``: the simulated members of each group issued the same collectives, in the same order, with the
  same sizes (``--verify`` simulates one whole group of each axis, so that each is compared in full).
* ``pipeline``: every send has its receive on the peer, same size and count, and the other way round.
* ``parameters``: the ranks of data replica 0 (context 0) hold, between them, every parameter of the model once
  (a parameter replicated over the tensor group counted on tensor rank 0, a weight tied across stages once).
* ``memory``: the largest rank's parameters, gradients and optimizer states within ``cluster.gpu_memory_gb``.
"""
from __future__ import annotations

from collections import Counter

from ..distributed.topology import Topology
from .ranks import compress, expand


def _result(name: str, bad: list, detail: str, ok_detail: str, skipped: str | None = None) -> dict:
    if skipped:
        return {"name": name, "ok": None, "detail": skipped, "ranks": []}
    ranks = sorted({r for r, _ in bad})
    return {"name": name, "ok": not bad, "detail": "; ".join(d for _, d in bad[:5]) if bad else ok_detail,
            "ranks": ranks}


def check_groups(reports: list[dict], topology: Topology) -> dict:
    by_rank = {r["rank"]: r for r in reports}
    bad = []
    for r in reports:
        for axis, members in r["groups"].items():
            want = compress(topology.group_of(r["rank"], axis))
            if members != want:
                bad.append((r["rank"], f"rank {r['rank']}'s {axis} group is {members}, the topology's {want}"))
                continue  # its members are compared from their own side
            for m in expand(members):
                other = by_rank.get(m)
                if other is not None and other["groups"].get(axis) != members:
                    bad.append((m, f"rank {r['rank']} has {axis} group {members}, its member {m} has "
                                   f"{other['groups'].get(axis)}"))
    return _result("groups", bad, "", f"{len(reports)} ranks agree with each other and the topology")


def check_collectives(reports: list[dict]) -> dict:
    by_rank = {r["rank"]: r for r in reports}
    bad, compared = [], 0
    keys = sorted({k for r in reports for k in r["sequences"]})
    for key in keys:
        members = [m for m in expand(key) if m in by_rank]
        if len(members) < 2:
            continue
        compared += 1
        first = members[0]
        want = by_rank[first]["sequences"].get(key, [])
        for m in members[1:]:
            got = by_rank[m]["sequences"].get(key, [])
            if got != want:
                at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                          min(len(got), len(want)))
                bad.append((m, f"group {key}: rank {m} issues {len(got)} collectives, rank {first} {len(want)}; "
                               f"the first difference at call {at + 1}: "
                               f"{got[at] if at < len(got) else 'none'} vs {want[at] if at < len(want) else 'none'}"))
    return _result("collectives", bad, "", f"{compared} groups with two or more simulated members issue the same "
                   "collectives in the same order", None if compared else
                   "no group had two simulated members (a world of one rank; else add --verify)")


def check_pipeline(reports: list[dict]) -> dict:
    by_rank = {r["rank"]: r for r in reports}
    sends, recvs = Counter(), Counter()
    for r in reports:
        for c in r["collectives"]:
            if c["op"] == "send":
                sends[(r["rank"], c["peer"], c["bytes"])] += c["count"]
            elif c["op"] == "recv":
                recvs[(c["peer"], r["rank"], c["bytes"])] += c["count"]
    bad = []
    for (src, dst, n), count in sends.items():
        if dst in by_rank and recvs.get((src, dst, n), 0) != count:
            bad.append((src, f"rank {src} sends {count} x {n} bytes to {dst}, which receives "
                             f"{recvs.get((src, dst, n), 0)}"))
    for (src, dst, n), count in recvs.items():
        if src in by_rank and sends.get((src, dst, n), 0) != count:
            bad.append((dst, f"rank {dst} receives {count} x {n} bytes from {src}, which sends "
                             f"{sends.get((src, dst, n), 0)}"))
    pairs = {(s, d) for s, d, _ in sends if d in by_rank}
    return _result("pipeline", bad, "", f"{sum(sends.values())} sends, each with its receive ({len(pairs)} pairs)"
                   if sends else "no pipeline sends")


def check_parameters(reports: list[dict], topology: Topology, model_count: int) -> dict:
    replica = [r for r in range(topology.world_size) if topology.coord(r).dp == 0 and topology.coord(r).cp == 0]
    by_rank = {r["rank"]: r for r in reports}
    missing = [r for r in replica if r not in by_rank]
    if missing:
        return _result("parameters", [], "", "", f"ranks {compress(missing)} of data replica 0 not simulated")
    total = sum(by_rank[r]["parameters_counted"] for r in replica)
    bad = [] if total == model_count else [(r, f"data replica 0 ({compress(replica)}) holds {total:,} parameters, "
                                                f"the model {model_count:,}") for r in replica]
    return _result("parameters", bad, "", f"data replica 0 holds the model's {model_count:,} parameters once")


def check_memory(reports: list[dict], gpu_memory_gb: float | None) -> dict:
    largest = max(reports, key=lambda r: r["bytes"]["total"])
    held = largest["bytes"]["total"]
    if not gpu_memory_gb:
        return _result("memory", [], "", "", "the recipe gives no cluster.gpu_memory_gb")
    limit = gpu_memory_gb * 1e9
    text = (f"rank {largest['rank']} holds {held / 1e9:.2f} GB of parameters, gradients and optimizer states, "
            f"of {gpu_memory_gb:g} GB")
    return _result("memory", [(largest["rank"], text)] if held > limit else [], "", text)


def run_checks(reports: list[dict], topology: Topology, model_count: int, gpu_memory_gb: float | None) -> list[dict]:
    return [check_groups(reports, topology), check_collectives(reports), check_pipeline(reports),
            check_parameters(reports, topology, model_count), check_memory(reports, gpu_memory_gb)]
