"""Documents packed into ``seq_len`` windows: the stream ``doc_0 EOS doc_1 EOS ...`` cut into ``floor(n / seq_len)``
windows (the tail dropped), each a row ``{"input_ids": w, "labels": w}`` (labels shifted inside the loss; no
padding, so no mask: attention crosses document boundaries, as GPT-2 pretraining and transformers' run_clm do).
``engine.dataloader(windows, seed=...)`` then gives every layout the same global batch at step i."""
from __future__ import annotations

import torch

from ..errors import PluginError


class PackedWindows(torch.utils.data.Dataset):
    """A map-style dataset of packed windows (an int64 tensor ``[n, seq_len]``)."""

    def __init__(self, windows: torch.Tensor):
        self.windows = windows

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, i):
        w = self.windows[i]
        return {"input_ids": w, "labels": w}

    def split(self, eval_fraction: float = 0.1) -> tuple[PackedWindows, PackedWindows]:
        """(train, eval): the last ``eval_fraction`` of the windows for evaluation, never shuffled in."""
        n_eval = int(len(self) * eval_fraction)
        return PackedWindows(self.windows[:len(self) - n_eval]), PackedWindows(self.windows[len(self) - n_eval:])


def pack(token_lists: list[list[int]], eos_id: int, seq_len: int) -> PackedWindows:
    stream = []
    for ids in token_lists:
        stream += ids
        stream.append(eos_id)
    n = len(stream) // seq_len
    if n == 0:
        raise PluginError(f"{len(stream):,} tokens make no window of seq_len {seq_len} -> more data, or a smaller "
                          "model.seq_len")
    return PackedWindows(torch.tensor(stream[:n * seq_len], dtype=torch.int64).view(n, seq_len))


def check_enough(windows: PackedWindows, seq_len: int, global_batch: int) -> None:
    """Refuse fewer windows than one global batch, before training."""
    if len(windows) < global_batch:
        raise PluginError(f"{len(windows) * seq_len:,} tokens = {len(windows)} windows of seq_len {seq_len}, fewer "
                          f"than one global batch ({global_batch} rows) -> more data, a smaller batch.global or "
                          "seq_len")
