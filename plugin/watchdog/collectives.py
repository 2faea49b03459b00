"""What torch knows of this rank's process groups, read for the guard: every group it is in (the plugin's, and those
DeepSpeed, FSDP2 or a pipeline schedule made), the last collective entered on each, the ones it waits in now, their
timeouts, and the abort.

* :func:`groups_of_this_rank`: ``{name: (process group, ranks)}`` from torch's registry of groups; torch's group
  names (``"0"`` the default group, then a counter) are the same on every rank, since every rank creates every group
  in the same order.
* :func:`sequence_numbers`: the per-group counter torch increments as an op is entered (gloo: every op, the flight
  recorder's ``op_id``; NCCL: collectives, its ``collective_seq_id``), read by the heartbeat thread: the main thread
  pays nothing for it.
* :func:`flight_record`, :func:`pending`, :func:`latest`: the collectives and point-to-point ops this rank entered,
  from torch's flight recorder (``_dump_fr_trace_json``: on gloo an entry's ``retired`` turns true once its work
  completed, or failed: a collective gloo timed out is retired too, so :func:`latest` keeps what it was; on NCCL its
  ``state`` becomes ``completed``). The dump serialises the whole ring on gloo (2000 entries by default: about 40 ms
  here), so the guard reads it at a timeout only; on NCCL once per beat (only active entries are serialised there).
* :func:`set_timeouts`: every group's timeout (``_set_pg_timeout``, what torchtitan uses to change them after start),
  for the groups the back ends make without one (DeepSpeed's, FSDP2's: ``new_group`` defaults to 30 min on gloo).
* :func:`abort_all`: ``_abort_process_group()`` on the world (every group), given a few seconds, in a thread.
"""
from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def groups_of_this_rank() -> dict[str, tuple]:
    """``{group name: (process group, sorted global ranks)}`` for every group this rank is a member of."""
    out = {}
    for pg, name in list(c10d._world.pg_names.items()):
        try:
            out[str(name)] = (pg, tuple(sorted(dist.get_process_group_ranks(pg))))
        except (RuntimeError, ValueError):  # destroyed meanwhile
            continue
    return out


def sequence_numbers(groups: dict[str, tuple]) -> dict[str, int]:
    out = {}
    for name, (pg, _) in groups.items():
        try:
            out[name] = int(pg._get_sequence_number_for_group())
        except (RuntimeError, AttributeError):
            continue
    return out


def flight_record(only_active: bool = True) -> list[dict]:
    """This rank's flight-recorder entries as ``{"group", "seq", "op", "p2p", "age_s", "done"}`` (see the module)."""
    try:
        raw = torch._C._distributed_c10d._dump_fr_trace_json(True, only_active)
    except (RuntimeError, AttributeError):
        return []
    now = time.time_ns()
    out = []
    for e in json.loads(raw).get("entries", []):
        p2p = bool(e.get("is_p2p"))
        backend, _, op = str(e.get("profiling_name", "?:?")).rpartition(":")
        # in the units of sequence_numbers: gloo's counter counts every op (the entry's op_id; gloo records no p2p
        # ops), NCCL's only collectives (collective_seq_id)
        seq = e.get("p2p_seq_id") if p2p else e.get("op_id") if backend == "gloo" else e.get("collective_seq_id")
        out.append({"group": str((e.get("process_group") or ["?"])[0]), "seq": int(seq or 0), "op": op, "p2p": p2p,
                    "age_s": round((now - int(e.get("time_created_ns", now))) / 1e9, 3),
                    "done": bool(e.get("retired")) or e.get("state") == "completed"})
    return out


def pending(entries: list[dict]) -> list[dict]:
    """The oldest op per group still waiting (not completed), oldest first."""
    oldest: dict[str, dict] = {}
    for e in entries:
        if not e["done"] and (e["group"] not in oldest or e["age_s"] > oldest[e["group"]]["age_s"]):
            oldest[e["group"]] = e
    return sorted(oldest.values(), key=lambda p: -p["age_s"])


def latest(entries: list[dict]) -> dict[str, dict]:
    """The newest entry per group, done or not: what a collective that gloo gave up on (and retired) was."""
    newest: dict[str, dict] = {}
    for e in entries:
        if e["group"] not in newest or e["age_s"] <= newest[e["group"]]["age_s"]:
            newest[e["group"]] = e
    return newest


def set_timeouts(seconds: float) -> None:
    """Every group of this rank waits at most ``seconds`` in a collective from now on."""
    timeout = timedelta(seconds=seconds)
    for pg, _ in groups_of_this_rank().values():
        try:
            c10d._set_pg_timeout(timeout, pg)
        except (RuntimeError, ValueError):  # a backend that takes no timeout
            continue


def abort_all(wait_s: float = 3.0) -> None:
    """Abort every process group (NCCL releases its kernels; gloo closes its pairs), not waiting past ``wait_s``."""
    if not dist.is_initialized():
        return

    def abort():
        try:
            c10d._abort_process_group()
        except Exception:  # noqa: BLE001 - the process is about to exit: nothing left to tell
            pass

    t = threading.Thread(target=abort, daemon=True, name="watchdog-abort")
    t.start()
    t.join(wait_s)
