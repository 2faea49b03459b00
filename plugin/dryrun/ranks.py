"""Rank lists, pure: read from ``--ranks`` (``0,5,7-9`` or ``all``), written compressed (``0-7``, ``0,128,...,896``),
and the ranks a dry run simulates by default.

>>> compress([0, 1, 2, 3, 4, 5, 6, 7])
'0-7'
>>> compress(list(range(0, 1024, 128)))
'0,128,...,896'
>>> compress([0, 5, 7, 8, 9])
'0,5,7-9'
>>> parse_ranks("0,5,7-9", 16)
[0, 5, 7, 8, 9]
"""
from __future__ import annotations

from ..distributed.topology import Topology
from ..errors import PluginError


def compress(ranks) -> str:
    """A sorted list of ranks in a few characters: a run of consecutive ranks as ``a-b``, an arithmetic series of
    four or more as ``a,b,...,z``, else comma-separated."""
    ranks = sorted(ranks)
    if not ranks:
        return ""
    if len(ranks) >= 4:
        step = ranks[1] - ranks[0]
        if step > 1 and all(b - a == step for a, b in zip(ranks, ranks[1:], strict=False)):
            return f"{ranks[0]},{ranks[1]},...,{ranks[-1]}"
    parts, start = [], 0
    for i in range(1, len(ranks) + 1):
        if i == len(ranks) or ranks[i] != ranks[i - 1] + 1:
            run = ranks[start:i]
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]},{run[1]}" if len(run) == 2
                         else f"{run[0]}-{run[-1]}")
            start = i
    return ",".join(parts)


def expand(text: str) -> list[int]:
    """The ranks of a :func:`compress`-ed list.

    >>> expand("0,128,...,896") == list(range(0, 1024, 128))
    True
    >>> expand("0,5,7-9")
    [0, 5, 7, 8, 9]
    """
    parts = text.split(",")
    if len(parts) == 4 and parts[2] == "...":
        first, second, last = int(parts[0]), int(parts[1]), int(parts[3])
        return list(range(first, last + 1, second - first))
    out = []
    for part in parts:
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def parse_ranks(text: str, world_size: int) -> list[int]:
    """``all``, or ranks and ranges (``0,5,7-9``), each inside the world; sorted, without repeats."""
    if text.strip() == "all":
        return list(range(world_size))
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        try:
            lo, _, hi = part.partition("-")
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise PluginError(f"--ranks {text!r}: {part!r} is not a rank or a range -> use e.g. 0,5,7-9 or all") \
                from None
        if not 0 <= first <= last < world_size:
            raise PluginError(f"--ranks {text!r}: {part!r} is outside the world of {world_size} ranks (0-"
                              f"{world_size - 1})")
        out.update(range(first, last + 1))
    return sorted(out)


def default_ranks(topology: Topology) -> list[int]:
    """Every rank of data replica 0 and context 0 (each pipeline stage and tensor rank once), and the last rank.

    >>> default_ranks(Topology(pp_size=2, dp_size=4, tp_size=2))
    [0, 1, 8, 9, 15]
    """
    picked = {r for r in range(topology.world_size) if topology.coord(r).dp == 0 and topology.coord(r).cp == 0}
    return sorted(picked | {topology.world_size - 1})


def verify_ranks(topology: Topology) -> list[int]:
    """``--verify``: one whole group of each axis (the groups of rank 0 and of the last rank), so that every member
    of those groups is simulated and their collectives compared."""
    out: set[int] = set()
    for rank in (0, topology.world_size - 1):
        for axis in topology.AXES:
            out.update(topology.group_of(rank, axis))
    return sorted(out)
