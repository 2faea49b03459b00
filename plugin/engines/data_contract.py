"""The data contract: what each rank passes to ``train_step`` / ``eval_step``, checked on every step of every layout.

A rank passes either

* the **global batch** (``batch.global`` rows): then every rank must pass the same rows (each data rank keeps its
  share; per-process rows, ``DataLoader(dataset, batch_size=global, sampler=DistributedSampler(dataset))``, would
  train on 1/D of them and exit 0); or
* **its data rank's share** (``micro x grad_accum`` rows): then the ranks of one model replica (tensor peers,
  pipeline stages: the same ``data_rank``) must pass the same rows, and the shares must differ by data rank
  (identical shares train the same rows D times).

Anything else (another row count, e.g. a DataLoader's short last batch without ``drop_last=True``; some ranks the
global batch and others their share) is refused too. A refusal is a :class:`BatchMismatchError` raised on every rank
with the same message, before any update.

How cheap: each rank contributes its fingerprint (:func:`fingerprint`: the row count and one digest each of the
inputs and of the labels it was given), its share's target-token count, the labels' suspect and whether it deferred
its verdict to ONE collective, one round (:func:`start_exchange`), after which every rank holds every rank's and
reaches the same verdict with a few tensor operations (:func:`verdict`; up to 64 ranks on the CPU, in Python), and
the same message if it refuses (:func:`mismatch_message`, pure). The token count of the global batch, which the
default loss needs, is the sum of the replicas' counts, so where a rank was given its share this collective replaces
the all-reduce over the data group the loss made before, and the step waits for it before its forward.

Where the count is known without it (the global batch given, or data 1) the verdict is taken where the step waits
anyway, after its backward and before the update (:meth:`plugin.engines.base.Engine.rows_checked`: the native
engines, pipelines included, and DeepSpeed's but for its pipeline, whose ``train_batch`` updates inside), so the
collective runs behind forward and backward, provided every tensor the rank was given has the shapes (and dtypes,
and keys) of the last batch the contract accepted (:func:`shapes_of`). Only then are the forward's and backward's
collectives (tensor, context and data peers) sure to meet buffers of one size: a rank given other shapes (the first
step, a new sequence length, a wrong row count) waits before its forward. If that verdict refuses while peers
deferred theirs, the rank runs the last accepted rows beside them, so every rank refuses at the same point, after
its backward: the back end then drops what that backward left (:meth:`~plugin.engines.base.Engine.discard_step`)
and no update is ever applied. ``bench/data_contract.py`` measures the cost.

A digest is exact integer arithmetic on the tensor's bits (no float rounding, NaN equals itself): the bits
read as integers of the element's width, times fixed pseudo-random odd 64-bit weights, one per position,
summed modulo 2**64 (int64 wrap-around, the same whatever the reduction order or thread count). Position
matters, so a permutation of rows or a window shifted by one token changes it; a single changed element always
does (an odd weight times a non-zero difference is non-zero modulo 2**64), and unrelated rows collide only if
their weighted differences cancel modulo 2**64.
"""
from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..errors import PluginError
from .batches import flat_tensors

FIELDS = 3  # per rank: rows given, digest of the inputs, digest of the labels (and any further tensors)
SLOT = FIELDS + 3  # ... and, in the exchange, its share's target tokens, the labels' suspect and deferred (0 or 1)
_MAX_LISTED = 3  # mismatching data replicas spelled out in the message; the rest are counted
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SMALL_WORLD = 64  # up to this many ranks the verdict is taken in Python on the CPU (RowsExchange._small)


class BatchMismatchError(PluginError, ValueError):
    """The ranks were given rows that break the data contract (or a wrong row count); raised on every rank with the
    same message. Also a ``ValueError``, as a wrong row count was before."""


@functools.lru_cache(maxsize=16)
def _weights(numel: int, device: torch.device) -> torch.Tensor:
    """``numel`` odd pseudo-random int64 weights, the same on every rank (a fixed CPU generator)."""
    gen = torch.Generator().manual_seed(0x5EED_F1A6)
    w = torch.randint(-2 ** 63, 2 ** 63 - 1, (numel,), generator=gen, dtype=torch.int64) | 1
    return w.to(device)


@functools.lru_cache(maxsize=64)
def _meta_of(shape: tuple, dtype: torch.dtype) -> int:
    return zlib.crc32(repr((shape, str(dtype))).encode())


def _meta(t: torch.Tensor) -> int:
    """Shape and dtype as a number (crc32 of their text: Python's own str hash differs from process to process)."""
    return _meta_of(tuple(t.shape), t.dtype)


def _ints(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as a flat int64 tensor (the integers of its element width; complex128 and the like 8 bytes at a
    time)."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    width = flat.element_size()
    ints = flat.view(_INT_OF_WIDTH[width]) if width in _INT_OF_WIDTH else flat.view(torch.uint8).view(torch.int64)
    return ints if ints.dtype == torch.int64 else ints.to(torch.int64)


def digest(t: torch.Tensor) -> torch.Tensor:
    """An int64 scalar on ``t``'s device: the position-weighted sum of ``t``'s bits (see the module docstring)."""
    ints = _ints(t)
    return (ints * _weights(ints.numel(), ints.device)).sum() + _meta(t)


def _wrap(v: int) -> int:
    """``v`` modulo 2**64 as an int64 (two's complement), as torch's int64 arithmetic wraps."""
    return (v + 2 ** 63) % 2 ** 64 - 2 ** 63


def _digest_int(t: torch.Tensor) -> int:
    """:func:`digest` of a CPU tensor as a Python int: one matrix-vector product (int64, wrapping as the sum does)."""
    ints = _ints(t)
    return _wrap(int(ints @ _weights(ints.numel(), ints.device)) + _meta(t))


def fingerprint(batch, rows: int) -> torch.Tensor:
    """``[rows, digest(inputs), digest(labels, ...)]``, int64 on the batch's device; ``batch`` None (a rank whose
    row count is already wrong) gives zero digests. Inputs given as a dict (a Hugging Face batch) digest each
    value in sorted key order, each weighted apart."""
    if batch is None:
        return torch.tensor([rows, 0, 0], dtype=torch.int64)
    inputs, *rest = batch
    parts = flat_tensors(inputs)
    device = parts[0].device
    first = digest(parts[0])
    for i, t in enumerate(parts[1:], start=1):
        first = first + digest(t) * (2 * i + 1)
    labels = digest(rest[0]) if rest else torch.zeros((), dtype=torch.int64, device=device)
    for i, t in enumerate(rest[1:], start=1):  # whatever else the batch carries, each weighted apart
        labels = labels + digest(t) * (2 * i + 1)
    return torch.stack([torch.tensor(rows, dtype=torch.int64, device=device), first, labels])


def fingerprint_values(batch, rows: int) -> list[int] | None:
    """:func:`fingerprint` as Python ints when every tensor of ``batch`` is on the CPU (a data loader's batch: a
    third of the torch calls, no device sync), else None."""
    if batch is None:
        return [rows, 0, 0]
    inputs, *rest = batch
    parts = flat_tensors(inputs)
    if any(t.device.type != "cpu" for t in (*parts, *rest)):
        return None
    first = sum(_digest_int(t) * (2 * i + 1) for i, t in enumerate(parts))
    labels = sum(_digest_int(t) * (2 * i + 1) for i, t in enumerate(rest))
    return [rows, _wrap(first), _wrap(labels)]


def shapes_of(batch):
    """What the step's collectives depend on in ``batch`` (as given): its structure (a dict's keys, nested) and every
    tensor's shape and dtype; hashable, comparable between steps."""
    if isinstance(batch, dict):
        return tuple((k, shapes_of(batch[k])) for k in sorted(batch))
    if isinstance(batch, (tuple, list)):
        return tuple(shapes_of(item) for item in batch)
    return tuple(batch.shape), batch.dtype


def _who(topology, rank: int, with_data_rank: bool = False) -> str:
    """``rank 5 (stage 1, tensor 1)``: the rank and its place in its model replica (and its data rank)."""
    coord = topology.coord(rank)
    parts = ([f"data rank {coord.dp}"] if with_data_rank else []) + \
            ([f"stage {coord.pp}"] if topology.pp_size > 1 else []) + \
            ([f"context {coord.cp}"] if topology.cp_size > 1 else []) + \
            ([f"tensor {coord.tp}"] if topology.tp_size > 1 else [])
    return f"rank {rank} ({', '.join(parts)})" if parts else f"rank {rank}"


def _ranks_text(ranks: Sequence[int], word: str = "data rank") -> str:
    return f"{word} {ranks[0]}" if len(ranks) == 1 else f"{word}s {', '.join(map(str, ranks))}"


def mismatch_message(values: Sequence[Sequence[int]], topology, *, call: str, global_rows: int,
                     local_rows: int) -> str | None:
    """The refusal every rank raises, or None when the rows keep the data contract (the module docstring).

    ``values[r]`` is rank ``r``'s :func:`fingerprint` as ints. Pure (no torch, no collective): each rank reaches
    the same verdict from the same gathered values.
    """
    data, world = topology.dp_size, topology.world_size
    sampler = (f"DistributedSampler(dataset, num_replicas=engine.data_size, rank=engine.data_rank) (data_size {data} "
               f"here; without those arguments DistributedSampler shards over all {world} processes)")
    fix = (f"-> give every rank the global batch ({global_rows} rows; each data rank takes its share), or iterate "
           f"engine.dataloader(dataset), or shard rows by data rank, not by process: {sampler}")
    share_fix = (f"-> pass this data rank's share: iterate engine.dataloader(dataset), or {sampler} with batch_size "
                 f"= micro x grad_accum = {local_rows}; or the same {global_rows} rows on every rank")
    rows = [v[0] for v in values]
    wrong_rows = [r for r, n in enumerate(rows) if n not in (global_rows, local_rows)]
    if wrong_rows:
        expected = (f"every rank takes the global batch ({global_rows} rows) or its data rank's share (micro x "
                    f"grad_accum = {local_rows} rows)" + (", the same rows as its tensor, context and pipeline peers"
                                                           if world > data else ""))
        short = ("; a DataLoader ends each epoch with a short batch unless drop_last=True -> DataLoader(..., "
                 "drop_last=True), or iterate engine.dataloader(dataset) (it drops an incomplete last global batch), "
                 f"or shard by data rank: {sampler}")
        if len(wrong_rows) == world and len(set(rows)) == 1:
            return f"{call}: every rank got {rows[0]} rows; {expected}{short}"
        listed = ", ".join(f"{_who(topology, r, with_data_rank=True)} got {rows[r]}" for r in wrong_rows)
        return f"{call}: {listed} rows; {expected}{short}"
    lines, bad = [], 0
    replicas = topology.replica_groups()  # one per data replica, by data rank (tensor x context x pipeline)
    for dp_rank, ranks in enumerate(replicas):
        classes: dict[tuple, list[int]] = {}
        for r in ranks:
            classes.setdefault(tuple(values[r]), []).append(r)
        if len(classes) == 1:
            continue
        bad += 1
        if bad > _MAX_LISTED:
            continue
        keys = list(classes)
        differ = [name for i, name in enumerate(("rows", "inputs", "labels")) if len({k[i] for k in keys}) > 1]
        listed = " != ".join(" = ".join(_who(topology, r) for r in members) for members in classes.values())
        lines.append(f"  data rank {dp_rank}: {listed} ({' and '.join(differ)} differ)")
    if bad:
        if bad > _MAX_LISTED:
            lines.append(f"  and {bad - _MAX_LISTED} more data rank(s)")
        return (f"{call}: the ranks of one model replica were given different rows (tensor peers each compute a "
                "slice of the same rows; a pipeline's last stage meets the labels of the rows its first stage took), "
                "so nothing was trained:\n" + "\n".join(lines) + "\n" + fix)
    if global_rows == local_rows:  # data 1: one replica, and it agrees
        return None
    per_replica = [tuple(values[ranks[0]]) for ranks in replicas]
    kinds = {d: "global" if v[0] == global_rows else "share" for d, v in enumerate(per_replica)}
    if len(set(kinds.values())) > 1:
        whole = [d for d, k in kinds.items() if k == "global"]
        shares = [d for d, k in kinds.items() if k == "share"]
        return (f"{call}: {_ranks_text(whole)} passed the global batch ({global_rows} rows) and {_ranks_text(shares)} "
                f"their share ({local_rows} rows), so nothing was trained: every rank passes the one or every rank "
                f"the other {fix}")
    classes = {}
    for d, v in enumerate(per_replica):
        classes.setdefault(v, []).append(d)
    if kinds[0] == "global" and len(classes) > 1:
        listed = " != ".join(" = ".join(f"data rank {d}" for d in members) for members in classes.values())
        return (f"{call}: every rank passed {global_rows} rows, the global batch, but not the same rows on every "
                f"data rank ({listed}): each data rank keeps only its share ({local_rows} rows) of what it was given, "
                f"so {local_rows * data} of the {global_rows * len(classes)} rows passed would train and the rest "
                f"never, and nothing was trained {share_fix}")
    if kinds[0] == "share" and len(classes) < data:
        same = [members for members in classes.values() if len(members) > 1]
        listed = "; ".join(f"{_ranks_text(members)} the same {local_rows} rows" for members in same[:_MAX_LISTED])
        more = f" and {len(same) - _MAX_LISTED} more such group(s)" if len(same) > _MAX_LISTED else ""
        return (f"{call}: each data rank must train on its own share of the global batch, but {listed}{more} "
                "(identical shares train the same rows several times, as one process training each of them again), "
                f"so nothing was trained {share_fix}")
    return None


def verdict(table: torch.Tensor, topology, *, global_rows: int, local_rows: int) -> torch.Tensor:
    """``[ok, global target tokens, suspect, deferred]`` (int64, on ``table``'s device) from the gathered ``table``
    (``[world, SLOT]``: every rank's :func:`fingerprint`, share tokens, suspect and deferred, rank order), in a few
    tensor operations (a Python pass over thousands of ranks would cost milliseconds a step); ``ok`` exactly when
    :func:`mismatch_message` would find nothing; ``deferred`` whether any rank deferred its verdict.

    Ranks are ordered (pipeline, data, context, tensor), tensor fastest, so one model replica is ``[:, d, :]`` of the
    table viewed as ``[pipeline, data, context x tensor, SLOT]``; its ranks agree when all equal its first."""
    grid = table.view(topology.pp_size, topology.dp_size, topology.cp_size * topology.tp_size, SLOT)
    first = grid[0, :, 0]  # each replica's first rank: [data, SLOT]
    agree = (grid[..., :FIELDS] == first[None, :, None, :FIELDS]).all()
    rows, prints = first[:, 0], first[:, 1:FIELDS]
    kind_ok = (rows == global_rows).all()
    if global_rows != local_rows:
        kind_ok &= (prints == prints[:1]).all()
        if not kind_ok:  # not the same global batch everywhere: each replica its own share? (unique: ~0.1 ms)
            kind_ok = (rows == local_rows).all() & (torch.unique(prints, dim=0).shape[0] == topology.dp_size)
    return torch.stack([(agree & kind_ok).to(torch.int64), first[:, FIELDS].sum(), table[:, FIELDS + 1].max(),
                        table[:, FIELDS + 2].max()])


class Verdict:
    """What every rank learns from one exchange: the global batch's target ``tokens``, ``suspect`` (the most of any
    rank's), whether any rank ``deferred`` its verdict, and ``error``: the :class:`BatchMismatchError` every rank
    raises, or None."""

    def __init__(self, tokens: int, suspect: int, deferred: bool, error: BatchMismatchError | None):
        self.tokens, self.suspect, self.deferred, self.error = tokens, suspect, deferred, error


class RowsExchange:
    """One step's gather of every rank's fingerprint, started by :func:`start_exchange`; :meth:`finish` waits for it
    and gives the verdict."""

    def __init__(self, table: torch.Tensor, work, topology, global_rows: int, local_rows: int):
        self.table, self.work, self.topology = table, work, topology
        self.global_rows, self.local_rows = global_rows, local_rows

    def finish(self, call: str) -> Verdict:
        """Wait, and give the :class:`Verdict` (every rank reaches the same from the same table; no further
        collective)."""
        if self.work is not None:
            self.work.wait()
        if self.table.device.type == "cpu" and len(self.table) <= _SMALL_WORLD:
            return self._small(call)
        ok, tokens, suspect, deferred = verdict(self.table, self.topology, global_rows=self.global_rows,
                                                local_rows=self.local_rows).tolist()  # one read back to the host
        if ok:
            return Verdict(tokens, suspect, bool(deferred), None)
        values = [row[:FIELDS] for row in self.table.tolist()]
        message = mismatch_message(values, self.topology, call=call, global_rows=self.global_rows,
                                   local_rows=self.local_rows)
        assert message, "verdict and mismatch_message disagree"
        return Verdict(tokens, suspect, bool(deferred), BatchMismatchError(message))

    def _small(self, call: str) -> Verdict:
        """The verdict of a small world's table in Python (a few microseconds where :func:`verdict`'s tensor
        operations take tens): the same rows everywhere, the global batch's, agree at once; else
        :func:`mismatch_message` decides (a unit test holds it to :func:`verdict`)."""
        table, topo = self.table.tolist(), self.topology
        head = table[0][:FIELDS]
        message = None
        if head[0] != self.global_rows or any(row[:FIELDS] != head for row in table):
            message = mismatch_message([row[:FIELDS] for row in table], topo, call=call,
                                       global_rows=self.global_rows, local_rows=self.local_rows)
        stride = topo.cp_size * topo.tp_size  # each replica's first rank: data rank d at stage 0 is rank d x stride
        return Verdict(sum(table[d * stride][FIELDS] for d in range(topo.dp_size)),
                       max(row[FIELDS + 1] for row in table), bool(max(row[FIELDS + 2] for row in table)),
                       None if message is None else BatchMismatchError(message))


def start_exchange(given, rows: int, tokens, suspect: int, topology, *, global_rows: int, local_rows: int,
                   device: torch.device, deferred: bool = False) -> RowsExchange:
    """Start the step's one collective, which gives every rank every rank's fingerprint of ``given`` (what it was
    passed, None when its ``rows`` count is already wrong), the target ``tokens`` of its share (an int64 scalar),
    ``suspect`` (0 or 1: the labels look like the other convention) and ``deferred`` (it takes the verdict after its
    backward), and return before it is done (``async_op``): :meth:`RowsExchange.finish` waits. Every rank calls it,
    in the same place of its step.

    On gloo an all-to-all (each rank sends its ``SLOT`` int64 to every other at once: one round), measured here at
    a quarter to a half of an all-reduce's latency (a ring of ``2 (world - 1)`` rounds) and of gloo's all-gather; its
    world x world messages are no matter at the sizes gloo runs. On NCCL, whose all-gather is one ring kernel on the
    communicator it already holds, an all-gather. ``device``: where the process group's tensors live."""
    world = topology.world_size
    values = fingerprint_values(given, rows) if device.type == "cpu" else None
    if values is not None:  # what an all-to-all sends, made at once: one tensor, nothing concatenated or repeated
        mine = torch.tensor([*values, int(tokens), suspect, int(deferred)] * world, dtype=torch.int64)
    else:
        mine = torch.cat([fingerprint(given, rows).to(device),
                          torch.as_tensor(tokens, dtype=torch.int64).reshape(1).to(device),
                          torch.tensor([suspect, int(deferred)], dtype=torch.int64, device=device)])
    if world == 1:
        return RowsExchange(mine.view(1, SLOT), None, topology, global_rows, local_rows)
    table = torch.empty(world * SLOT, dtype=torch.int64, device=device)
    if dist.get_backend() == "gloo":
        send = mine if len(mine) == world * SLOT else mine.repeat(world)
        work = dist.all_to_all_single(table, send, async_op=True)
    else:
        work = dist.all_gather_into_tensor(table, mine[:SLOT], async_op=True)
    return RowsExchange(table.view(world, SLOT), work, topology, global_rows, local_rows)
