"""Who holds the job, from the ranks' ledgers and the topology: the one line every live rank prints and the triage
report the lowest live rank prints (pure: no torch, tested on made-up ledgers).

A timeout's evidence, gathered by :mod:`plugin.watchdog.guard`:

* ``ledgers``: each rank's last published ledger (:mod:`.ledger`: step, phase, detail, host, pid, ``t`` the wall
  time it was published, ``seqs`` the last collective it entered on each group), and for the ranks still alive at
  the timeout their final one, whose ``pending`` lists the collectives they wait in (group, sequence number, op,
  seconds), from torch's flight recorder;
* ``live``: the ranks that posted a final ledger; ``states``: what ``/proc`` says of a silent rank's process when it
  runs on the reporter's host (``stopped``: SIGSTOP or a debugger; ``gone``: exited).

A rank is **named** when it is missing (no final ledger: its heartbeat stopped, or it never started) or when it is
alive but others wait for it in a collective it has not entered (its ``seqs`` show an older number on that group)
and it waits in none itself: it is in its own code (a sleep, a long local phase). A waiting rank whose peers have
all entered its collective, or which waits for a rank that itself waits, is not named: the report shows the chain.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .ledger import coord_words, doing, group_kind, group_words

# gloo's words for a peer that is gone (its process died, its host is out of reach): the job stops at once
LOST = ("Connection closed by peer", "Connection reset by peer")
# what /proc says of a silent rank's process (plugin.watchdog.guard reads it) -> (Named.why, words)
STATE_WORDS = {"stopped": ("stopped", "stopped (its process is in state T: SIGSTOP or a debugger)"),
               "gone": ("gone", "dead (its process has exited)")}


@dataclass(frozen=True)
class Wait:
    """A live rank waiting in a collective (or a point-to-point op) on ``group`` for the ranks ``waiting_for``."""

    group: str
    ranks: tuple[int, ...]
    kind: str
    seq: int
    op: str
    age_s: float
    p2p: bool
    waiting_for: tuple[int, ...]

    def words(self) -> str:
        if self.p2p:
            return f"in pipeline {self.op} for {self.age_s:.0f} s"
        return f"in {self.op} #{self.seq} on {group_words(self.kind, self.ranks)} for {self.age_s:.0f} s"


@dataclass(frozen=True)
class Named:
    rank: int
    why: str  # "stopped", "gone", "silent", "never started", "behind"
    words: str


@dataclass
class Verdict:
    topology: object
    timeout_s: float
    cause: str
    named: list[Named]
    waits: dict[int, list[Wait]]
    live: set[int]
    ledgers: Mapping[int, Mapping]
    run_dir: str = ""
    groups: Mapping[str, Sequence[int]] = field(default_factory=dict)

    @property
    def named_ranks(self) -> list[int]:
        return [n.rank for n in self.named]

    def who(self, rank: int) -> str:
        """``rank 3: data 1, tensor 1, pipeline 0``."""
        return f"rank {rank}: {coord_words(self.topology, rank)}"

    def line(self, me: int) -> str:
        """The one line rank ``me`` prints (to stderr) before it exits."""
        if not self.named:
            return f"watchdog: rank {me} stops: {self.cause}; no rank could be named (see the report of the lowest " \
                   f"live rank{', ' + self.run_dir if self.run_dir else ''})"
        named = "; ".join(f"{self.who(n.rank)} ({n.words})" for n in self.named)
        return f"watchdog: rank {me} stops, the job is held by {named}"

    def report(self) -> str:
        """The triage report: what each named rank last did, what every other rank waits for."""
        how = "at once, a peer lost" if any(m in self.cause for m in LOST) else \
            f"after {self.timeout_s:g} s without progress"
        out = [f"watchdog: the job stopped {how}: {self.cause}"]
        if self.named:
            out.append("  held by:")
        for n in self.named:
            entry = self.ledgers.get(n.rank)
            where = f" on {entry['host']} (pid {entry['pid']})" if entry else ""
            out.append(f"    {self.who(n.rank)}{where}: {n.words}")
            if entry and n.why != "behind":
                out.append(f"      at its last heartbeat: {doing(entry)}")
            if entry:
                entered = self._entered(n.rank, entry)
                if entered:
                    out.append(f"      last collectives entered: {entered}")
            if n.why == "stopped":  # on this host: the guard ends it, or every launcher waits for it (DeepSpeed 30 s)
                out.append("      ended with SIGKILL after this report (a launcher would wait for a stopped process)")
        waiting = [r for r in sorted(self.live) if self.waits.get(r)]
        if waiting:
            out.append("  waiting:")
        for r in waiting:
            for w in self.waits[r]:
                chained = [f"rank {o}" + (" (waiting itself)" if self.waits.get(o) else "") for o in w.waiting_for]
                target = f": for {', '.join(chained)}" if chained else ": every member has entered it"
                out.append(f"    {self.who(r)} waits {w.words()}{target}")
        idle = [r for r in sorted(self.live) if not self.waits.get(r) and r not in self.named_ranks]
        for r in idle:
            out.append(f"    {self.who(r)}: {doing(self.ledgers.get(r, {}))}, not waiting")
        hosts = hosts_words(self.ledgers, range(self.topology.world_size))
        if hosts:
            out.append(f"  hosts: {hosts}")
        if self.run_dir:
            out.append(f"  ledgers (and NCCL flight-recorder dumps, on CUDA): {self.run_dir}")
        return "\n".join(out)

    def _entered(self, rank: int, entry: Mapping) -> str:
        seqs = entry.get("seqs") or {}
        involved = {w.group for ws in self.waits.values() for w in ws if rank in w.ranks}
        names = [g for g in seqs if g in involved] or list(seqs)
        parts = []
        for g in names:
            ranks = tuple(self.groups.get(g, ()))
            kind = group_kind(self.topology, ranks) if ranks else "group"
            parts.append(f"#{seqs[g]} on {group_words(kind, ranks)}" if ranks else f"#{seqs[g]} on group {g}")
        return ", ".join(parts[:6])


def hosts_words(ledgers: Mapping[int, Mapping], ranks) -> str:
    """``a: ranks 0-3; b: ranks 4-7`` from the ledgers' hosts (ranks without a ledger left out)."""
    by_host: dict[str, list[int]] = {}
    for r in ranks:
        entry = ledgers.get(r)
        if entry:
            by_host.setdefault(entry.get("host", "?"), []).append(r)
    return "; ".join(f"{h}: {'rank' if len(rs) == 1 else 'ranks'} {ranges(rs)}" for h, rs in by_host.items())


def ranges(ranks: Sequence[int]) -> str:
    """``0-3, 6``."""
    out, ranks = [], sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)


def judge(topology, ledgers: Mapping[int, Mapping], live: set[int], groups: Mapping[str, Sequence[int]], *,
          now: float, timeout_s: float, cause: str, states: Mapping[int, str] | None = None,
          run_dir: str = "") -> Verdict:
    """The :class:`Verdict` over every rank of ``topology`` (see the module's docstring)."""
    states = states or {}
    waits = {r: _waits_of(r, ledgers, live, groups, topology, timeout_s) for r in sorted(live)}
    waits = {r: w for r, w in waits.items() if w}
    named = []
    for r in range(topology.world_size):
        if r in live:
            continue
        entry = ledgers.get(r)
        if not entry:
            named.append(Named(r, "never started", "never started: no heartbeat at all"))
            continue
        silent = max(0.0, now - float(entry.get("t", now)))
        why, words = STATE_WORDS.get(states.get(r), ("silent", "stopped or dead"))
        named.append(Named(r, why, f"{words}: no heartbeat for {silent:.0f} s"))
    waited = {o for ws in waits.values() for w in ws for o in w.waiting_for}
    for r in sorted(waited & live):
        if waits.get(r):
            continue  # it waits itself: a link of the chain, not its end
        entry = ledgers.get(r, {})
        named.append(Named(r, "behind", f"alive but not in the collective its peers wait in: {doing(entry)} for "
                                        f"{float(entry.get('in_phase_s', 0)):.0f} s"))
    named.sort(key=lambda n: n.rank)
    return Verdict(topology, timeout_s, cause, named, waits, set(live), ledgers, run_dir, groups)


def _waits_of(r: int, ledgers, live, groups, topology, timeout_s) -> list[Wait]:
    """What live rank ``r`` waits in: the flight recorder's pending ops in its final ledger; without any (no flight
    recorder), the newest op it entered, when that is older than half the timeout: a collective some member has not
    entered (by their sequence numbers on that group), or a point-to-point op (a pipeline's send or recv)."""
    entry = ledgers.get(r, {})
    out = []

    def add(op: Mapping, ranks: tuple, waiting_for: tuple) -> None:
        out.append(Wait(group=op["group"], ranks=ranks, kind=group_kind(topology, ranks), seq=int(op.get("seq", 0)),
                        op=op.get("op", "collective"), age_s=float(op.get("age_s", 0.0)), p2p=bool(op.get("p2p")),
                        waiting_for=waiting_for))

    for p in entry.get("pending") or []:
        ranks = tuple(groups.get(p["group"], ()))
        if len(ranks) > 1:
            add(p, ranks, _waited_for(r, p, ranks, ledgers, live))
    if not out and entry.get("phase") in ("recv", "send") and entry.get("peer") is not None \
            and float(entry.get("in_phase_s", 0)) >= timeout_s / 2:  # gloo's flight recorder holds no p2p ops
        peer = int(entry["peer"])
        out.append(Wait(group="", ranks=tuple(sorted((r, peer))), kind="pipeline", seq=0,
                        op=f"{entry['phase']} of {entry.get('detail') or 'a tensor'} (rank {peer})",
                        age_s=float(entry["in_phase_s"]), p2p=True, waiting_for=(peer,)))
    latest = list((entry.get("latest") or {}).values())
    if not out and latest:
        newest = min(latest, key=lambda e: e.get("age_s", 0))
        ranks = tuple(groups.get(newest["group"], ()))
        if newest.get("age_s", 0) >= timeout_s / 2 and len(ranks) > 1:
            waiting_for = _waited_for(r, newest, ranks, ledgers, live)
            if waiting_for:
                add(newest, ranks, waiting_for)
    return out


def _waited_for(rank: int, pending: Mapping, ranks: Sequence[int], ledgers, live) -> tuple[int, ...]:
    """The members of ``ranks`` that ``rank``'s pending op waits for: a missing member, or one whose last entered
    collective on that group is older than the pending one (a point-to-point op: every member not waiting there)."""
    group, seq = pending["group"], int(pending.get("seq", 0))
    out = []
    for m in ranks:
        if m == rank:
            continue
        if m not in live:
            out.append(m)
            continue
        entry = ledgers.get(m, {})
        theirs = (entry.get("pending") or [])
        if pending.get("p2p"):
            if not any(p["group"] == group for p in theirs):
                out.append(m)
        elif int((entry.get("seqs") or {}).get(group, 0)) < seq:
            out.append(m)
    return tuple(out)


def layout_disagreement(rows: Sequence[tuple[int, int, int, int]], hosts: Mapping[int, str]) -> str:
    """The pre-flight's refusal when the ranks were launched with different layouts or recipes: ``rows[r]`` is rank
    r's ``(pipeline, data, tensor, recipe digest)``, ``hosts`` its host where known.

    >>> print(layout_disagreement([(1, 2, 2, 7), (1, 2, 2, 7), (1, 2, 2, 7), (1, 4, 1, 9)], {3: "b"}))
    the ranks were launched with different layouts or recipes, so their process groups cannot match:
      ranks 0-2: data 2 x tensor 2 x pipeline 1 (recipe digest 7)
      rank 3 on b: data 4 x tensor 1 x pipeline 1 (recipe digest 9)
    """
    by_row: dict[tuple, list[int]] = {}
    for r, row in enumerate(rows):
        by_row.setdefault(tuple(row), []).append(r)
    lines = ["the ranks were launched with different layouts or recipes, so their process groups cannot match:"]
    for (pp, dp, tp, digest), ranks in sorted(by_row.items(), key=lambda item: item[1][0]):
        where = sorted({hosts[r] for r in ranks if r in hosts})
        on = f" on {', '.join(where)}" if where else ""
        lines.append(f"  {'rank' if len(ranks) == 1 else 'ranks'} {ranges(ranks)}{on}: data {dp} x tensor {tp} x "
                     f"pipeline {pp} (recipe digest {digest})")
    return "\n".join(lines)


def store_silent_line(me: int, topology, store_rank: int, entry: Mapping | None, state: str | None, address: str,
                      silent_s: float, agent: bool) -> str:
    """The one line rank ``me`` prints when the watchdog's store itself has not answered for ``silent_s``: nobody's
    ledger can be read, so there is no report; the job is held by ``store_rank``, on whose host the store runs
    (``agent``: torchrun's agent serves it; else a process that rank forked), in ``state`` (what ``/proc`` says of
    that rank's process on this host, else None).

    >>> from plugin.distributed.topology import Topology
    >>> print(store_silent_line(1, Topology(dp_size=2), 0, {"host": "a", "pid": 7}, "stopped", "a:9", 21, False))
    watchdog: rank 1 stops, the job is held by rank 0: data 0, tensor 0, pipeline 0 on a (pid 7) (stopped ...; the ...
    >>> print(store_silent_line(1, Topology(dp_size=2), 0, None, None, "a:9", 21, True))
    watchdog: ... by rank 0: data 0, ... (its host stopped, or out of reach; ... by torchrun's agent on its host, ...
    """
    where = f" on {entry['host']} (pid {entry['pid']})" if entry else ""
    words = "its process runs" if state == "running" else \
        STATE_WORDS.get(state, ("", "its host stopped, or out of reach"))[1]
    served = "torchrun's agent on its host" if agent else f"a process rank {store_rank} forked"
    return (f"watchdog: rank {me} stops, the job is held by rank {store_rank}: {coord_words(topology, store_rank)}"
            f"{where} ({words}; the watchdog's store at {address}, served by {served}, has not answered for "
            f"{silent_s:.0f} s, so no report: it holds every rank's ledger)")


def rendezvous_line(me: int, topology, arrived: set[int] | None, address: str, waited_s: float,
                    error: str = "") -> str | None:
    """The one line rank ``me`` prints when the world's rendezvous failed: ``arrived``, the ranks that checked in at
    the rendezvous store at ``address`` (None: this rank never reached it, ``error`` says why). None when every rank
    had checked in (the failure is another one).

    >>> from plugin.distributed.topology import Topology
    >>> t = Topology(dp_size=2, tp_size=2)
    >>> print(rendezvous_line(0, t, {0, 1, 2}, "10.0.0.1:29500", 20))
    watchdog: rank 0 stops, the rendezvous at 10.0.0.1:29500 did not complete in 20 s: rank 3: data 1, tensor 1, ...
    >>> print(rendezvous_line(0, t, {0, 1, 2}, "10.0.0.1:29500", 20))
    watchdog: ... pipeline 0 never reached it (ranks 0-2 did) -> start it with the MASTER_ADDR and MASTER_PORT the ...
    >>> print(rendezvous_line(3, t, None, "10.0.0.9:29500", 20, "connect timed out"))
    watchdog: rank 3 stops, it could not reach the rendezvous at 10.0.0.9:29500 (its MASTER_ADDR:MASTER_PORT) in ...
    >>> rendezvous_line(0, t, {0, 1, 2, 3}, "10.0.0.1:29500", 20) is None  # every rank checked in: another failure
    True
    """
    if arrived is None:
        why = f" ({error})" if error else ""
        return (f"watchdog: rank {me} stops, it could not reach the rendezvous at {address} (its "
                f"MASTER_ADDR:MASTER_PORT) in {waited_s:.0f} s{why} -> give every rank rank 0's address and port (the "
                "same --master_addr and --master_port on every node), reachable from this host")
    missing = [r for r in range(topology.world_size) if r not in arrived]
    if not missing:
        return None
    who = "; ".join(f"rank {r}: {coord_words(topology, r)}" for r in missing[:8])
    more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
    did = f"{'rank' if len(arrived) == 1 else 'ranks'} {ranges(sorted(arrived))} did"
    them, whose = ("it", "its launcher's") if len(missing) == 1 else ("them", "their launchers'")
    return (f"watchdog: rank {me} stops, the rendezvous at {address} did not complete in {waited_s:.0f} s: {who}{more} "
            f"never reached it ({did}) -> start {them} with the MASTER_ADDR and MASTER_PORT the others have "
            f"({address}: {whose} --master_addr and "
            "--master_port), from a host that reaches that address")
