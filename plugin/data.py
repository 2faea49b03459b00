"""Real text on every machine without a download: byte-level text of Python's own standard library.

The corpus is the sorted ``.py`` files of the running interpreter's standard library, concatenated (the
same bytes on every rank and every run of one Python build). Batches are drawn by (seed, step) alone, so
step ``i`` sees the same global batch whatever the layout; each data-parallel rank then takes its rows.
Tokens are bytes modulo the vocabulary (ASCII maps to itself when vocab >= 128).
"""
from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

import torch

EVAL_FRACTION = 0.1


@functools.lru_cache(maxsize=2)
def stdlib_corpus(max_bytes: int = 4_000_000) -> torch.Tensor:
    """Up to ``max_bytes`` of standard-library source as a uint8 tensor."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    corpus = b"".join(chunks)[:max_bytes]
    if len(corpus) < 100_000:
        raise RuntimeError(f"found only {len(corpus)} bytes of Python sources under {root}")
    return torch.frombuffer(bytearray(corpus), dtype=torch.uint8)


class TextBatches:
    """Deterministic (inputs, labels) batches of next-byte prediction, ``[rows, seq_len]`` int64 each."""

    def __init__(self, vocab: int, seq_len: int, seed: int = 0):
        corpus = stdlib_corpus()
        split = int(len(corpus) * (1 - EVAL_FRACTION))
        self._splits = {"train": corpus[:split], "eval": corpus[split:]}
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed

    def global_batch(self, step: int, rows: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of ``step``: a function of (seed, step, rows) only."""
        text = self._splits[split]
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 2 + (split == "eval"))
        starts = torch.randint(0, len(text) - self.seq_len - 1, (rows,), generator=gen)
        window = torch.arange(self.seq_len + 1)
        tokens = text[starts[:, None] + window[None, :]].long() % self.vocab
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def shard_rows(batch, dp_rank: int, dp_size: int):
    """This data rank's contiguous share of a global batch (a tensor or a tuple of tensors)."""
    if isinstance(batch, (tuple, list)):
        return type(batch)(shard_rows(b, dp_rank, dp_size) for b in batch)
    rows = batch.shape[0]
    if rows % dp_size:
        raise ValueError(f"a global batch of {rows} rows does not split over {dp_size} data-parallel ranks")
    share = rows // dp_size
    return batch[dp_rank * share:(dp_rank + 1) * share]


def micro_batches(batch, count: int):
    """Split a (tuple of) tensor(s) into ``count`` equal micro-batches along the first dim."""
    if isinstance(batch, (tuple, list)):
        parts = [micro_batches(b, count) for b in batch]
        return [type(batch)(p[i] for p in parts) for i in range(count)]
    if batch.shape[0] % count:
        raise ValueError(f"{batch.shape[0]} rows do not split into {count} micro-batches")
    return list(batch.chunk(count))
