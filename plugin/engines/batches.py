"""What a batch is, and splitting it the way every back end does: this data rank's share of a global batch, then
micro-batches.

Two kinds of batch (:func:`split_batch`):

* a pair ``(inputs, labels)``: labels already shifted (``labels[:, t]`` is the target of position ``t``), the
  plugin's own convention (:data:`SHIFTED`);
* a mapping, Hugging Face style: ``input_ids``, ``labels`` (labels = input ids, shifted inside the loss, ``-100``
  ignored: :data:`HF`), optional ``attention_mask``, ``position_ids`` and any other tensor the model takes as a
  keyword argument.

Every value is split along the first dimension; the shares are contiguous, so data rank ``d`` of ``D`` trains on
rows ``[d * rows / D, (d + 1) * rows / D)`` (the cut the step loader makes too, :mod:`plugin.data.loader`).
"""
from __future__ import annotations

from collections.abc import Mapping

from ..errors import PluginError

SHIFTED = "shifted"  # (inputs, labels) with labels[:, t] the target of position t
HF = "hf"            # {"input_ids", "labels", ...}: labels = input ids, shifted inside the loss
IGNORE_INDEX = -100  # a label the loss skips (padding, prompt tokens), as in Hugging Face and torch


def split_batch(batch):
    """``(inputs, labels, convention)``: ``inputs`` a tensor or a dict of tensors (every key but ``labels``)."""
    import torch

    if isinstance(batch, Mapping):
        keys = sorted(batch)
        if "input_ids" not in batch or "labels" not in batch:
            missing = [k for k in ("input_ids", "labels") if k not in batch]
            raise PluginError(f"a dict batch needs {' and '.join(repr(k) for k in missing)} (it has {keys}) -> "
                              "pass input_ids and labels = input_ids (shifted inside the loss, -100 ignored)")
        if "num_items_in_batch" in batch:
            raise PluginError("a dict batch holds 'num_items_in_batch': the plugin counts the target tokens of the "
                              "global batch itself -> drop the key")
        bad = [k for k in keys if not isinstance(batch[k], torch.Tensor)]
        if bad:
            kinds = ", ".join(f"{k!r} is {type(batch[k]).__name__}" for k in bad)
            raise PluginError(f"a dict batch must hold tensors: {kinds} -> collate into tensors")
        rows = {k: batch[k].shape[0] if batch[k].dim() else None for k in keys}
        if len(set(rows.values())) != 1:
            raise PluginError(f"a dict batch's values have different row counts ({rows}) -> every value needs "
                              "one row per sequence")
        return {k: batch[k] for k in keys if k != "labels"}, batch["labels"], HF
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1], SHIFTED
    raise PluginError(f"a batch is (inputs, labels) or a dict with input_ids and labels, not {type(batch).__name__}"
                      + (f" of {len(batch)} items" if isinstance(batch, (tuple, list)) else ""))


def rows_of(x) -> int:
    """Rows of a tensor, a dict of tensors (its ``input_ids``) or a tuple of them (its first item)."""
    if isinstance(x, Mapping):
        return rows_of(x["input_ids"] if "input_ids" in x else next(iter(x.values())))
    if isinstance(x, (tuple, list)):
        return rows_of(x[0])
    return x.shape[0]


def flat_tensors(x) -> list:
    """Every tensor of a (nested) batch, dict values in sorted key order: what the data contract digests."""
    if isinstance(x, Mapping):
        return [t for k in sorted(x) for t in flat_tensors(x[k])]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in flat_tensors(item)]
    return [x]


def map_tensors(x, fn):
    """``x`` with ``fn`` applied to each tensor, the same structure (dict, tuple, list) around them."""
    if isinstance(x, Mapping):
        return {k: map_tensors(v, fn) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(map_tensors(v, fn) for v in x)
    return fn(x)


def shard_rows(batch, dp_rank: int, dp_size: int):
    """This data rank's contiguous share of a global batch (a tensor, or a tuple or dict of tensors)."""
    if isinstance(batch, Mapping):
        return {k: shard_rows(v, dp_rank, dp_size) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(shard_rows(b, dp_rank, dp_size) for b in batch)
    rows = batch.shape[0]
    if rows % dp_size:
        raise ValueError(f"a global batch of {rows} rows does not split over {dp_size} data-parallel ranks")
    share = rows // dp_size
    return batch[dp_rank * share:(dp_rank + 1) * share]


def micro_batches(batch, count: int):
    """Split a (tuple or dict of) tensor(s) into ``count`` equal micro-batches along the first dim."""
    if isinstance(batch, Mapping):
        parts = {k: micro_batches(v, count) for k, v in batch.items()}
        return [{k: p[i] for k, p in parts.items()} for i in range(count)]
    if isinstance(batch, (tuple, list)):
        parts = [micro_batches(b, count) for b in batch]
        return [type(batch)(p[i] for p in parts) for i in range(count)]
    if batch.shape[0] % count:
        raise ValueError(f"{batch.shape[0]} rows do not split into {count} micro-batches")
    return list(batch.chunk(count))


def target_count(labels, convention: str):
    """The number of tokens the loss counts in ``labels`` (an int64 tensor): under :data:`HF` the shift drops each
    row's first label; ``-100`` is never counted."""
    import torch

    if convention == HF:
        labels = labels[:, 1:]
    return (labels != IGNORE_INDEX).sum().to(torch.int64)
