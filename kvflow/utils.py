"""Small helpers shared across kvflow: byte sizes as users write them."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}


def parse_bytes(text: str | int, name: str = "byte size") -> int:
    """A byte count from an int or a string such as "536870912", "512MiB", "8GiB", "1.5G",
    "2GB" (KiB/MiB/GiB/TiB and bare K/M/G/T are powers of 1024, KB/MB/GB/TB powers of
    1000; case-insensitive). Used by ``EngineArgs`` (``kv_cache_memory_bytes``,
    ``swap_space_bytes``), their CLI flags and ``kvflow memory --budget``.

    Args:
        text: the size.
        name: what the size is, for the error message (e.g. "kv_cache_memory_bytes").

    Raises:
        ValueError: naming ``name``, for an unparsable or negative size, a bool or a float.
    """
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ValueError(f"{name} must be a byte count (an int, or a string like '512MiB'), got {text!r}")
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"{name}: cannot parse a byte size from {text!r} (examples: 536870912, 512MiB, 8GiB, 2GB)")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value < 0:
        raise ValueError(f"{name} must be non-negative, got {text!r}")
    return value


def human_bytes(n: float) -> str:
    """1024-based: 524288 -> "512 KiB", 46080 -> "45 KiB", 3.5 * 2**30 -> "3.5 GiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or float(n).is_integer() else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
