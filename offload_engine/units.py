"""Byte sizes: the constants (``MiB``, ``PAGE``) and sizes as people write them: "8GiB"
(binary), "5GB" (decimal), "4096", 4096."""

from __future__ import annotations

import re
from .errors import InputError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
# bytes: the page, and the alignment O_DIRECT needs of an address, offset and length on
# every device we target; chunk files and pool buffers are whole pages
PAGE = 4096

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4, "p": 1000**5, "pb": 1000**5,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "pib": 1 << 50,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """Bytes from an int or a string like "8GiB", "1.5 GB", "512MiB", "4096".

    Decimal units (KB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB)
    powers of 1024, as Hugging Face and the SI/IEC standards use them.
    """
    if isinstance(value, bool):
        raise InputError(f"not a size: {value!r}")
    if isinstance(value, (int, float)):
        if value < 0 or int(value) != value:
            raise InputError(f"size must be a non-negative whole number of bytes, got {value!r}")
        return int(value)
    m = _SIZE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise InputError(f"not a size: {value!r} (examples: 4096, \"64MiB\", \"8GiB\", \"5GB\")")
    number = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if number != int(number):
        raise InputError(f"size {value!r} is not a whole number of bytes")
    return int(number)


def format_bytes(nbytes: int | float) -> str:
    """Human-readable binary size: 1536 -> "1.50 KiB"."""
    n = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
