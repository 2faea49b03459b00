"""Where one rank is: the ledger its main thread keeps at phase boundaries and its heartbeat publishes (pure).

The main thread only ever replaces one tuple (:meth:`Ledger.enter`: step, phase, detail, when), which costs a
fraction of a microsecond, at phase boundaries, never per tensor operation:

=============  ==========================================================================================
``build``      from the process group's creation until the engine exists (materialising, wrapping)
``preflight``  the first all-reduce of each group (``detail``: the group)
``step``       inside ``train_step`` before the first forward (the batch: the data contract's check)
``forward``    the forward of micro-batch k of the step (``detail``: ``micro-batch k``)
``backward``   the backward of micro-batch k (under pipeline stages: the stage's own backward of it)
``recv``       a pipeline stage waits for activations (or gradients) of micro-batch k from stage j; ``send``: to it
               (``peer``: the rank that stage runs on)
``optimizer``  the optimizer's step (after the gradients' reductions and clipping)
``eval``       ``eval_step``; ``checkpoint``: ``save`` or ``load``
``user``       between calls into the engine: the user's loop (the next batch, logging, their own code)
=============  ==========================================================================================

What the heartbeat publishes (:meth:`Ledger.record`) adds, per process group the rank is in, the sequence number of
the last collective it entered there (torch's own per-group counter, read by the heartbeat, so the main thread pays
nothing), and at a timeout the collectives it is waiting in (torch's flight recorder). Groups are named by torch's
group name, the same on every rank; :func:`group_kind` says which axes a group spans.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence

from ..monitor.rank_map import AXIS_NAMES

PHASES = ("start", "build", "preflight", "step", "forward", "backward", "recv", "send", "optimizer", "eval",
          "checkpoint", "user", "close")


class Ledger:
    """This rank's place, written by its main thread (:meth:`enter`), read by its heartbeat (:meth:`record`)."""

    def __init__(self, rank: int, host: str | None = None, pid: int | None = None):
        self.rank = rank
        self.host = host or socket.gethostname()
        self.pid = pid or os.getpid()
        self.step = 0  # the last step train_step finished (the one running is step + 1)
        self.state = (0, "start", "", time.monotonic(), None)
        self.version = 0
        self.forwards = 0  # forwards of micro-batches in the running step
        self.stepped = threading.Event()  # set as a step begins: the heartbeat publishes then, not only at its beat

    def enter(self, phase: str, detail: str = "", peer: int | None = None) -> None:
        """Mark a phase boundary: one tuple replaced (atomic for the heartbeat thread that reads it). ``peer``: the
        rank a ``recv`` or ``send`` waits on."""
        self.state = (self.step, phase, detail, time.monotonic(), peer)
        self.version += 1

    @property
    def since(self) -> float:
        """When the current phase began (``time.monotonic``)."""
        return self.state[3]

    def record(self, now: float | None = None) -> dict:
        """The published form: rank, host, pid, step, phase, detail, peer and seconds in the phase."""
        step, phase, detail, since, peer = self.state
        now = time.monotonic() if now is None else now
        return {"rank": self.rank, "host": self.host, "pid": self.pid, "step": step, "phase": phase,
                "detail": detail, "peer": peer, "in_phase_s": round(now - since, 3)}


def doing(entry: Mapping) -> str:
    """What a published ledger says its rank was doing, in words.

    >>> doing({"step": 4, "phase": "backward", "detail": "micro-batch 2"})
    'step 5, backward of micro-batch 2'
    >>> doing({"step": 0, "phase": "recv", "detail": "activations of micro-batch 3 from stage 1"})
    'step 1, pipeline recv of activations of micro-batch 3 from stage 1'
    >>> doing({"step": 4, "phase": "user", "detail": ""})
    'in the training loop after step 4 (not inside the engine)'
    >>> doing({"step": 0, "phase": "preflight", "detail": "the data group [0, 2]"})
    'pre-flight: the data group [0, 2]'
    """
    step, phase, detail = entry.get("step", 0), entry.get("phase", "?"), entry.get("detail", "")
    if phase in ("forward", "backward"):
        return f"step {step + 1}, {phase}" + (f" of {detail}" if detail else "")
    if phase in ("recv", "send"):
        return f"step {step + 1}, pipeline {phase}" + (f" of {detail}" if detail else "")
    if phase in ("step", "optimizer"):
        return f"step {step + 1}, " + ("the batch (before the first forward)" if phase == "step" else "optimizer step")
    if phase == "user":
        return f"in the training loop after step {step} (not inside the engine)" if step else \
            "in the training loop before step 1 (not inside the engine)"
    if phase == "preflight":
        return f"pre-flight: {detail}" if detail else "pre-flight"
    words = {"start": "starting", "build": "building the engine", "eval": "eval_step", "checkpoint": "a checkpoint",
             "close": "closing the engine"}
    return words.get(phase, phase) + (f" ({detail})" if detail else "") + (f" after step {step}" if step else "")


def coord_words(topology, rank: int) -> str:
    """``data 1, tensor 1, pipeline 0``: the rank's coordinate on every axis of ``topology``, data and tensor first.

    >>> from plugin.distributed.topology import Topology
    >>> coord_words(Topology(pp_size=1, dp_size=2, tp_size=2), 3)
    'data 1, tensor 1, pipeline 0'
    >>> coord_words(Topology(dp_size=2, tp_size=2, cp_size=2), 3)
    'data 0, tensor 1, pipeline 0, context 1'
    """
    coord = topology.coord(rank)
    # an optional axis (context) is named only when the layout has it
    shown = [f for f in coord._fields if f in ("pp", "dp", "tp") or getattr(topology, f"{f}_size", 1) > 1]
    fields = sorted(shown, key=lambda f: (f != "dp", f != "tp", coord._fields.index(f)))
    return ", ".join(f"{AXIS_NAMES.get(f, f)} {getattr(coord, f)}" for f in fields)


def group_kind(topology, ranks: Sequence[int]) -> str:
    """Which axes a group spans, in the recipe's words: ``tensor``, ``data``, ``pipeline``, ``model`` (tensor and
    pipeline), ``world``; a group that spans an axis only in part (a tie between the first and last stage of four, a
    DeepSpeed group between two stages) is ``part of the pipeline axis``.

    >>> from plugin.distributed.topology import Topology
    >>> t = Topology(pp_size=4, dp_size=2, tp_size=2)
    >>> group_kind(t, [0, 1]), group_kind(t, [0, 2]), group_kind(t, [0, 4, 8, 12]), group_kind(t, [0, 12])
    ('tensor', 'data', 'pipeline', 'part of the pipeline axis')
    >>> group_kind(t, range(16)), group_kind(t, [0, 1, 4, 5, 8, 9, 12, 13]), group_kind(t, [3])
    ('world', 'model', 'single')
    """
    ranks = sorted(ranks)
    if len(ranks) == topology.world_size:
        return "world"
    if len(ranks) == 1:
        return "single"
    coords = [topology.coord(r) for r in ranks]
    fields = coords[0]._fields
    varying = [f for f in fields if len({getattr(c, f) for c in coords}) > 1]
    whole = len(ranks) == _size(topology, varying)
    words = sorted((AXIS_NAMES.get(f, f) for f in varying), key=lambda w: ("tensor", "data", "pipeline").index(w)
                   if w in ("tensor", "data", "pipeline") else 9)
    name = "model" if set(varying) == {"tp", "pp"} else " x ".join(words)
    if whole:
        return name
    return f"part of the {name} axis" if len(varying) == 1 else f"part of the {name} axes"


def _size(topology, fields) -> int:
    n = 1
    for f in fields:
        n *= getattr(topology, f"{f}_size", 1)
    return n


def group_words(kind: str, ranks: Sequence[int]) -> str:
    """``the tensor group [0, 1]``; a partial one: ``the group [0, 12] (part of the pipeline axis)``."""
    listed = f"[{', '.join(str(r) for r in ranks)}]"
    if kind.startswith("part of") or kind == "single":
        return f"the group {listed} ({kind})"
    return f"the {kind} group {listed}"
