"""zarr v3 fill values: the JSON spelling in zarr.json <-> one element's little-endian bytes.

Arrays the engine writes have a zero fill; foreign arrays may have any value the spec
allows. Zero needs no numpy type at all (its bytes are zeros), so opening a bfloat16 array
of ours does not import ml_dtypes.
"""

from __future__ import annotations

import math

from ..dtypes import DType
from ..errors import InputError

_PYTHON_TYPE = {"bool": bool, "int": int, "uint": int, "float": float}


def default_fill_json(t: DType):
    """The fill value the engine writes: zero, spelled as the type's JSON kind."""
    return {"bool": False, "float": 0.0}.get(t.kind, 0)


def fill_to_bytes(t: DType, value) -> bytes:
    """Little-endian bytes of one element equal to the JSON fill ``value``.

    Accepts the zarr v3 spellings: true/false for bool, integers for ints, and for floats a
    number, "NaN", "Infinity", "-Infinity" or "0x" + the element's bits as hex (big-endian
    digits, 2 per byte). Raises ValueError for anything else or out of range.
    """
    if t.kind == "bool":
        if not isinstance(value, bool):
            raise InputError(f"bool fill value must be true or false, got {value!r}")
        return bytes([int(value)])
    if t.kind in ("int", "uint"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(f"{t.name} fill value must be an integer, got {value!r}")
        bits = 8 * t.itemsize
        lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if t.kind == "int" else (0, (1 << bits) - 1)
        if not lo <= value <= hi:
            raise InputError(f"fill value {value} out of range for {t.name}")
        return int(value).to_bytes(t.itemsize, "little", signed=t.kind == "int")
    if isinstance(value, str) and value.startswith("0x"):
        digits = value[2:]
        if len(digits) != 2 * t.itemsize:
            raise InputError(f"hex fill value {value!r} for {t.name} needs "
                             f"{2 * t.itemsize} hex digits")
        return int(digits, 16).to_bytes(t.itemsize, "little")
    specials = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
    if isinstance(value, str) and value in specials:
        value = specials[value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{t.name} fill value must be a number, 'NaN', 'Infinity', "
                         f"'-Infinity' or a hex bit pattern, got {value!r}")
    if value == 0 and math.copysign(1.0, value) > 0:
        return bytes(t.itemsize)  # +0.0 is all zero bits in every float type
    import numpy as np

    return np.array([value], dtype=t.numpy).tobytes()


def bytes_to_scalar(t: DType, raw: bytes):
    """The Python scalar (bool, int or float) that one element's little-endian bytes hold."""
    if not any(raw):
        return _PYTHON_TYPE[t.kind](0)
    if t.kind != "float":
        if t.kind == "bool":
            return bool(raw[0])
        return int.from_bytes(raw, "little", signed=t.kind == "int")
    import numpy as np

    return float(np.frombuffer(raw, dtype=t.numpy, count=1)[0])


def fill_pattern(view: memoryview, element_bytes: bytes) -> None:
    """Fill the bytes ``view`` with repeats of one element's bytes (numpy, no Python loop)."""
    import numpy as np

    if not len(view):
        return
    target = np.frombuffer(view, dtype=np.uint8)
    if not any(element_bytes):
        target[:] = 0
        return
    target.reshape(-1, len(element_bytes))[:] = np.frombuffer(element_bytes, dtype=np.uint8)
