"""Real text on every machine without a download: byte-level text of Python's own standard library.

The corpus is the sorted ``.py`` files of the running interpreter's standard library, concatenated (the
same bytes on every rank and every run of one Python build). Batches are drawn by (seed, step) alone, so
step ``i`` sees the same global batch whatever the layout; each data-parallel rank then takes its rows
(``engine.train_step`` does, :func:`plugin.engines.batches.shard_rows`).
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
        # its own generator, seeded by (seed, step, split) alone: torch's default stream (dropout, the user's own
        # draws) is left alone, and a resumed run draws the batches the uninterrupted one did
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 2 + (split == "eval"))
        starts = torch.randint(0, len(text) - self.seq_len - 1, (rows,), generator=gen)
        window = torch.arange(self.seq_len + 1)
        tokens = text[starts[:, None] + window[None, :]].long() % self.vocab
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
