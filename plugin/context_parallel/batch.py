"""An engine's batch cut into this context rank's chunks: every rank of a context group is given the same rows (the
data contract holds them to it) and keeps its two chunks of each row's sequence (:mod:`.chunks`).

Labels are shifted first when they are Hugging Face's (labels = input ids, shifted inside the loss): the shift moves
each chunk's last target into the next chunk, so it is made on the whole row (``labels[:, t + 1]`` at position
``t``, ``-100`` at the end), and the loss then reads the chunks' labels as already shifted. The global batch's target
count is taken before the cut, so the token-weighted loss divides by the whole batch's tokens.

A dict's ``input_ids`` and every value with the sequence in dim 1 (``position_ids``, ``token_type_ids``...) are cut;
a transformers model is given ``position_ids`` (the chunks' global positions) when the batch has none, for its
rotary tables; ``attention_mask`` leaves the dict: all ones it says nothing under a causal mask, and otherwise its
whole ``[rows, seq]`` key mask travels as the keyword ``context_key_mask`` to the context attention (transformers
passes a model's extra keywords down to its attention function).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from .chunks import local_positions, take_chunks

KEY_MASK = "context_key_mask"  # the keyword a transformers attention function receives the whole key mask as
IGNORE_INDEX = -100


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face labels as the plugin's shifted ones: ``out[:, t] = labels[:, t + 1]``, ``-100`` at the end."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)


def context_share(inputs, labels: torch.Tensor, hf_labels: bool, cp_rank: int, cp_size: int, *,
                  positions: bool = False):
    """``(inputs, labels)`` of this context rank: its chunks of every row (see the module docstring). ``hf_labels``:
    the labels are Hugging Face's (shifted here first); ``positions``: add ``position_ids`` to a dict batch that has
    none (a transformers model)."""
    if hf_labels:
        labels = shifted(labels)
    seq = labels.shape[1]

    def cut(t):
        return take_chunks(t, 1, cp_rank, cp_size) if t.dim() >= 2 and t.shape[1] == seq else t

    if not isinstance(inputs, Mapping):
        if not positions:
            return cut(inputs), cut(labels)
        inputs = {"input_ids": inputs}  # a transformers model takes the chunks' positions beside them
    out = {k: cut(v) for k, v in inputs.items() if k != "attention_mask"}
    mask = inputs.get("attention_mask")
    if mask is not None and mask.dim() == 2 and not bool(mask.bool().all()):
        out[KEY_MASK] = mask.bool()
    if positions and "position_ids" not in out:
        pos = local_positions(cp_rank, cp_size, seq, labels.device)
        out["position_ids"] = pos.unsqueeze(0).expand(labels.shape[0], -1)
    return out, cut(labels)
