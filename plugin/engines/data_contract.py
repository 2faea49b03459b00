"""The data contract: the ranks of one model replica (its tensor peers and pipeline stages) train on the same rows.

Tensor peers each compute a slice of the same rows, and a pipeline's last stage meets the labels of the rows
its first stage embedded: if they were handed different rows (``DistributedSampler(dataset)`` shards over
every process, the tutorials' pattern), the job trains on a mix and exits 0. So every ``train_step`` and
``eval_step`` of a layout with tensor or pipeline > 1 compares a fingerprint of this rank's rows with its
model-group peers before anything runs, and refuses a mismatch on every rank of the world.

How cheap: a fingerprint is 3 int64 per rank (:func:`fingerprint`: the row count and one digest each of the
inputs and of the labels), gathered over the whole world (:func:`_gather_everywhere`: one all-gather, or on
gloo one all-to-all). It is world-wide, not per model group, on purpose: every rank then holds every group's
fingerprints and reaches the same verdict (:func:`mismatch_message`), so the ranks of a data replica whose own
peers agree raise too, instead of hanging in their next collective with the replica that stopped.

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
_MAX_LISTED = 3  # mismatching data replicas spelled out in the message; the rest are counted
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class BatchMismatchError(PluginError, ValueError):
    """Ranks of one model replica were given different rows (or a rank a wrong row count); raised on every rank.

    Also a ``ValueError``, as the row-count refusal of a data-parallel-only layout is."""


@functools.lru_cache(maxsize=16)
def _weights(numel: int, device: torch.device) -> torch.Tensor:
    """``numel`` odd pseudo-random int64 weights, the same on every rank (a fixed CPU generator)."""
    gen = torch.Generator().manual_seed(0x5EED_F1A6)
    w = torch.randint(-2 ** 63, 2 ** 63 - 1, (numel,), generator=gen, dtype=torch.int64) | 1
    return w.to(device)


def _meta(t: torch.Tensor) -> int:
    """Shape and dtype as a number (crc32 of their text: Python's own str hash differs from process to process)."""
    return zlib.crc32(repr((tuple(t.shape), str(t.dtype))).encode())


def digest(t: torch.Tensor) -> torch.Tensor:
    """An int64 scalar on ``t``'s device: the position-weighted sum of ``t``'s bits (see the module docstring)."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    width = flat.element_size()
    if width in _INT_OF_WIDTH:
        ints = flat.view(_INT_OF_WIDTH[width])
    else:  # complex128 and the like: read the bytes 8 at a time
        ints = flat.view(torch.uint8).view(torch.int64)
    ints = ints.to(torch.int64)
    return (ints * _weights(ints.numel(), ints.device)).sum() + _meta(t)


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


def _who(topology, rank: int, with_data_rank: bool = False) -> str:
    """``rank 5 (stage 1, tensor 1)``: the rank and its place in its model replica (and its data rank)."""
    coord = topology.coord(rank)
    parts = ([f"data rank {coord.dp}"] if with_data_rank else []) + \
            ([f"stage {coord.pp}"] if topology.pp_size > 1 else []) + \
            ([f"context {coord.cp}"] if topology.cp_size > 1 else []) + \
            ([f"tensor {coord.tp}"] if topology.tp_size > 1 else [])
    return f"rank {rank} ({', '.join(parts)})"


def mismatch_message(values: Sequence[Sequence[int]], topology, *, call: str, global_rows: int,
                     local_rows: int) -> str | None:
    """The refusal every rank raises, or None when every model replica's ranks were given the same rows.

    ``values[r]`` is rank ``r``'s :func:`fingerprint` as ints. Pure (no torch, no collective): each rank reaches
    the same verdict from the same gathered values.
    """
    fix = (f"-> give every rank the global batch ({global_rows} rows; each data rank takes its share), or iterate "
           "engine.dataloader(dataset), or shard rows by data rank, not by process: DistributedSampler(dataset, "
           f"num_replicas=engine.data_size, rank=engine.data_rank) (data_size {topology.dp_size} here; without "
           f"those arguments DistributedSampler shards over all {topology.world_size} processes)")
    wrong_rows = [r for r, v in enumerate(values) if v[0] not in (global_rows, local_rows)]
    if wrong_rows:
        listed = ", ".join(f"{_who(topology, r, with_data_rank=True)} got {values[r][0]}" for r in wrong_rows)
        return (f"{call}: {listed} rows; every rank takes the global batch ({global_rows} rows) or its data rank's "
                f"share (micro x grad_accum = {local_rows} rows), the same rows as its tensor and pipeline peers "
                f"{fix}")
    lines, bad = [], 0
    for dp_rank, ranks in enumerate(topology.replica_groups()):  # one per data replica, by data rank
        classes: dict[tuple, list[int]] = {}
        for r in ranks:
            classes.setdefault(tuple(values[r][1:]), []).append(r)
        if len(classes) == 1:
            continue
        bad += 1
        if bad > _MAX_LISTED:
            continue
        keys = list(classes)
        differ = [name for i, name in enumerate(("inputs", "labels")) if len({k[i] for k in keys}) > 1]
        listed = " != ".join(" = ".join(_who(topology, r) for r in members) for members in classes.values())
        lines.append(f"  data rank {dp_rank}: {listed} ({' and '.join(differ)} differ)")
    if not bad:
        return None
    if bad > _MAX_LISTED:
        lines.append(f"  and {bad - _MAX_LISTED} more data rank(s)")
    return (f"{call}: the ranks of one model replica were given different rows (tensor peers each compute a slice "
            "of the same rows; a pipeline's last stage meets the labels of the rows its first stage took), so "
            "nothing was trained:\n" + "\n".join(lines) + "\n" + fix)


def all_agree(table: torch.Tensor, topology, *, global_rows: int, local_rows: int) -> bool:
    """Whether :func:`mismatch_message` would find nothing in ``table`` (every rank's fingerprint, rank order),
    in a few tensor operations: a Python pass over thousands of ranks would cost milliseconds a step.

    Ranks are ordered (pipeline, data, context, tensor), tensor fastest, so one model replica is ``[:, d, :]`` of the
    table viewed as ``[pipeline, data, context x tensor, FIELDS]``; its ranks agree when all equal its first."""
    grid = table.view(topology.pp_size, topology.dp_size, topology.cp_size * topology.tp_size, FIELDS)
    rows = grid[..., 0]
    rows_ok = ((rows == global_rows) | (rows == local_rows)).all()
    same = (grid[..., 1:] == grid[:1, :, :1, 1:]).all()
    return bool(rows_ok & same)  # one read back to the host


def _gather_everywhere(mine: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every rank's ``mine``, in rank order, on every rank (``world_size * FIELDS`` int64): one collective.

    On gloo an all-to-all (each rank sends its 24 bytes to every other at once: one round), measured at about
    half the latency of gloo's ring all-gather (``world - 1`` rounds) with 4 processes, and below a gather plus
    a broadcast (bench/data_contract.py's machine); its world x world messages are no matter at the sizes gloo
    runs. On NCCL, whose all-gather is one ring kernel on the communicator it already holds, an all-gather."""
    table = torch.empty(world_size * FIELDS, dtype=torch.int64, device=mine.device)
    if dist.get_backend() == "gloo":
        dist.all_to_all_single(table, mine.repeat(world_size))
    else:
        dist.all_gather_into_tensor(table, mine)
    return table


def check_same_rows(batch, rows: int, topology, *, call: str, global_rows: int, local_rows: int,
                    device: torch.device) -> None:
    """Raise :class:`BatchMismatchError` on every rank unless each model replica's ranks hold the same rows.

    A collective over the world (every rank calls it, each with its own share ``batch``, or None when its
    ``rows`` count is wrong). ``device``: where the process group's tensors live (the engine's device).
    """
    mine = fingerprint(batch, rows).to(device)
    table = _gather_everywhere(mine, topology.world_size)
    if all_agree(table, topology, global_rows=global_rows, local_rows=local_rows):  # the common case: tensor ops
        return
    flat = table.tolist()
    values = [flat[r * FIELDS:(r + 1) * FIELDS] for r in range(topology.world_size)]
    message = mismatch_message(values, topology, call=call, global_rows=global_rows, local_rows=local_rows)
    assert message, "all_agree and mismatch_message disagree"
    raise BatchMismatchError(message)
