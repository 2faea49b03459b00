"""The seed of one init unit (pure: no torch).

>>> unit_seed(0, "blocks.0.attn.qkv")
2279953589064509504
>>> unit_seed(0, "blocks.0.attn.qkv") == unit_seed(0, "blocks.1.attn.qkv")
False
"""
from __future__ import annotations

import hashlib


def unit_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed for the module called ``name`` under the run's ``seed``: blake2b of both, so every
    process (and every layout) derives the same number; Python's ``hash()`` is salted per process."""
    digest = hashlib.blake2b(f"{int(seed)}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
