"""Byte sizes for people: ``"80GB"`` -> bytes, and bytes -> ``"61.3 GB"``.

GB means 10^9 bytes everywhere in the plugin's output (the unit GPU vendors and the recipe's
``cluster.gpu_memory_gb`` use); GiB (2^30) appears only where it is written out. Pure.
"""
from __future__ import annotations

import re

GB = 10**9
GIB = 2**30

_UNITS = {
    "": GB,  # a bare number is gigabytes, like cluster.gpu_memory_gb
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": GB, "tb": 10**12,
    "k": 10**3, "m": 10**6, "g": GB, "t": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": GIB, "tib": 2**40,
}

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> float:
    """``"80GB"`` -> 80e9, ``"80GiB"`` -> 80 * 2**30, ``"80"`` -> 80e9 (a bare number is GB).

    Raises ValueError with the accepted forms when the text is not a size.

    >>> parse_size("80GB"), parse_size("80GiB") == 80 * 2**30, parse_size("40")
    (80000000000.0, True, 40000000000.0)
    >>> parse_size("80 parsecs")
    Traceback (most recent call last):
    ...
    ValueError: '80 parsecs' is not a memory size; write it like 80GB, 80GiB, 40 (GB) or 512MiB
    """
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a memory size; write it like 80GB, 80GiB, 40 (GB) or 512MiB")
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"{text!r}: a memory size must be positive")
    return value


def gb(nbytes: float) -> float:
    """Bytes -> GB (10^9)."""
    return nbytes / GB


def fmt_gb(nbytes: float, digits: int = 1) -> str:
    """``61.3 GB``; small values keep more digits so they do not print as 0.0.

    >>> fmt_gb(61.3e9), fmt_gb(1e5)
    ('61.3 GB', '0.0001 GB')
    """
    value = nbytes / GB
    if 0 < abs(value) < 0.5 * 10 ** -digits:
        return f"{value:.{digits + 3}f} GB"
    return f"{value:.{digits}f} GB"


def fmt_bytes(nbytes: float) -> str:
    """GB (10^9) from 0.1 GB up, MB (10^6) below, kB below that: always labelled.

    >>> fmt_bytes(2.5e8), fmt_bytes(3e5), fmt_bytes(512)
    ('0.25 GB', '0.30 MB', '0.51 kB')
    """
    value = abs(nbytes)
    if value >= 0.1 * GB:
        return f"{nbytes / GB:.2f} GB"
    if value >= 0.1 * 10**6:
        return f"{nbytes / 10**6:.2f} MB"
    return f"{nbytes / 10**3:.2f} kB"


def fmt_seconds(seconds: float) -> str:
    """``1.23 s``, ``45.6 ms`` or ``12.0 us``.

    >>> fmt_seconds(1.234), fmt_seconds(0.0456), fmt_seconds(1.2e-5)
    ('1.23 s', '45.6 ms', '12.0 us')
    """
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.1f} us"
