"""The one precision table: what each of the recipe's ``precision`` values means to each tool. Pure.

The DeepSpeed config names its switches after the recipe's words (``bf16.enabled``, ``fp16.enabled``); Accelerate calls
fp32 ``"no"`` (``--mixed_precision``, ``Accelerator(mixed_precision=...)``); torch computes in ``torch.bfloat16`` /
``torch.float16`` and keeps fp32 as it is; the estimates count 4 or 2 bytes a value. The torch dtype is written by name,
so that this table imports no torch: :func:`plugin.engines.precision.compute_dtype` turns it into the dtype.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Precision:
    """One recipe precision, in each tool's words."""

    name: str  # the recipe's: fp32, bf16, fp16
    accelerate: str  # Accelerate's mixed_precision
    torch_dtype: str | None  # the attribute of torch the compute runs in; None: fp32, no autocast, no cast
    bytes_per_value: int  # an activation's or a 16-bit parameter's size, as the estimates count it


PRECISIONS = {
    "fp32": Precision("fp32", accelerate="no", torch_dtype=None, bytes_per_value=4),
    "bf16": Precision("bf16", accelerate="bf16", torch_dtype="bfloat16", bytes_per_value=2),
    "fp16": Precision("fp16", accelerate="fp16", torch_dtype="float16", bytes_per_value=2),
}
