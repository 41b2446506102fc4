"""Element types: torch dtypes <-> zarr v3 ``data_type`` names, and zarr-python's bfloat16.

Chunk files hold raw little-endian element bytes, and the engine moves them straight into
torch tensors, so a type is usable only when torch's in-memory layout of it is exactly the
zarr type's little-endian encoding. That holds for every type below on a little-endian
host (every host torch supports in practice); the check at import makes the assumption
explicit instead of silently byte-swapped data on a big-endian machine.

zarr-python (3.1) has no ``bfloat16``; :class:`BFloat16` is the registered extension type
``"bfloat16"`` (zarr-extensions ``data-types/bfloat16``) for it, backed by
``ml_dtypes.bfloat16``. It mixes in ``HasEndianness`` because without it zarr-python writes
a ``bytes`` codec with no ``endian``, which tensorstore refuses for 2-byte types.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import ClassVar, Literal, Self, TypeGuard

import ml_dtypes
import numpy as np
import torch
from zarr.core.dtype.common import (DataTypeValidationError, HasEndianness, HasItemSize,
                                    check_dtype_spec_v2)
from zarr.core.dtype.wrapper import ZDType
from zarr.dtype import data_type_registry

if sys.byteorder != "little":  # pragma: no cover - no such host in our fleet
    raise ImportError("offload_engine.layout moves raw little-endian bytes into tensors and "
                      "needs a little-endian host")


@dataclass(frozen=True)
class ElementType:
    """One element type: its zarr v3 name, torch dtype, little-endian numpy dtype, bytes per element."""

    zarr_name: str
    torch_dtype: torch.dtype
    numpy_dtype: np.dtype
    itemsize: int  # bytes

    @property
    def kind(self) -> str:
        """'bool', 'int' or 'float' (how the JSON fill value is spelled)."""
        if self.torch_dtype == torch.bool:
            return "bool"
        return "float" if self.torch_dtype.is_floating_point else "int"


_TYPES = [
    ElementType("bool", torch.bool, np.dtype("bool"), 1),
    ElementType("int8", torch.int8, np.dtype("<i1"), 1),
    ElementType("uint8", torch.uint8, np.dtype("<u1"), 1),
    ElementType("int16", torch.int16, np.dtype("<i2"), 2),
    ElementType("uint16", torch.uint16, np.dtype("<u2"), 2),
    ElementType("int32", torch.int32, np.dtype("<i4"), 4),
    ElementType("uint32", torch.uint32, np.dtype("<u4"), 4),
    ElementType("int64", torch.int64, np.dtype("<i8"), 8),
    ElementType("uint64", torch.uint64, np.dtype("<u8"), 8),
    ElementType("float16", torch.float16, np.dtype("<f2"), 2),
    ElementType("bfloat16", torch.bfloat16, np.dtype(ml_dtypes.bfloat16), 2),
    ElementType("float32", torch.float32, np.dtype("<f4"), 4),
    ElementType("float64", torch.float64, np.dtype("<f8"), 8),
]
_BY_ZARR = {t.zarr_name: t for t in _TYPES}
_BY_TORCH = {t.torch_dtype: t for t in _TYPES}

ZARR_NAMES = tuple(_BY_ZARR)


def from_torch(dtype: torch.dtype) -> ElementType:
    """The element type of a torch dtype; ValueError for one we cannot store."""
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise ValueError(f"torch dtype {dtype} has no zarr v3 element type here; supported: "
                         f"{', '.join(str(t.torch_dtype) for t in _TYPES)}") from None


def from_zarr(name: object) -> ElementType | None:
    """The element type of a zarr v3 ``data_type`` value, or None when unsupported."""
    return _BY_ZARR.get(name) if isinstance(name, str) else None


def torch_to_zarr(dtype: torch.dtype) -> str:
    """zarr v3 ``data_type`` name for a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return from_torch(dtype).zarr_name


def zarr_to_torch(name: str) -> torch.dtype:
    """torch dtype for a zarr v3 ``data_type`` name; ValueError when unsupported."""
    t = from_zarr(name)
    if t is None:
        raise ValueError(f"zarr data type {name!r} has no torch equivalent here; supported: "
                         f"{', '.join(ZARR_NAMES)}")
    return t.torch_dtype


# -- fill values -----------------------------------------------------------------------------
def default_fill_json(t: ElementType):
    """The fill value the engine writes: zero, spelled as the type's JSON kind."""
    return {"bool": False, "int": 0, "float": 0.0}[t.kind]


def fill_to_bytes(t: ElementType, value) -> bytes:
    """Little-endian bytes of one element equal to the JSON fill ``value``.

    Accepts the zarr v3 spellings: true/false for bool, integers for ints, and for floats a
    number, "NaN", "Infinity", "-Infinity" or "0x" + the element's bits as hex (big-endian
    digits, 2 per byte). Raises ValueError for anything else or out of range.
    """
    if t.kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"bool fill value must be true or false, got {value!r}")
        return bytes([int(value)])
    if t.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{t.zarr_name} fill value must be an integer, got {value!r}")
        info = np.iinfo(t.numpy_dtype)
        if not info.min <= value <= info.max:
            raise ValueError(f"fill value {value} out of range for {t.zarr_name}")
        return int(value).to_bytes(t.itemsize, "little", signed=info.min < 0)
    if isinstance(value, str) and value.startswith("0x"):
        digits = value[2:]
        if len(digits) != 2 * t.itemsize:
            raise ValueError(f"hex fill value {value!r} for {t.zarr_name} needs "
                             f"{2 * t.itemsize} hex digits")
        return int(digits, 16).to_bytes(t.itemsize, "little")
    specials = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
    if isinstance(value, str) and value in specials:
        value = specials[value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{t.zarr_name} fill value must be a number, 'NaN', 'Infinity', "
                         f"'-Infinity' or a hex bit pattern, got {value!r}")
    return np.array([value], dtype=t.numpy_dtype).tobytes()


def bytes_to_scalar(t: ElementType, raw: bytes):
    """The Python scalar (bool, int or float) that one element's little-endian bytes hold."""
    value = np.frombuffer(raw, dtype=t.numpy_dtype, count=1)[0]
    return {"bool": bool, "int": int, "float": float}[t.kind](value)


# -- zarr-python bfloat16 ----------------------------------------------------------------------
_BF16 = np.dtype(ml_dtypes.bfloat16)
_BF16_NAN_BITS = 0x7FC0


def _bf16_bits(value) -> int:
    return int(np.array([value], dtype=_BF16).view(np.uint16)[0])


@dataclass(frozen=True, kw_only=True)
class BFloat16(ZDType[type(_BF16), ml_dtypes.bfloat16], HasEndianness, HasItemSize):
    """zarr-python data type ``"bfloat16"``: 1 sign, 8 exponent, 7 mantissa bits, 2 bytes.

    Fill values use the IEEE spellings of the extension spec (numbers, "NaN", "Infinity",
    "-Infinity", "0xXXXX" bit patterns). Only little endian has a numpy form
    (``ml_dtypes`` has no byte-swapped bfloat16), so a big-endian bfloat16 array raises a
    DataTypeValidationError when zarr-python decodes it rather than returning swapped bytes.
    """

    dtype_cls: ClassVar[type] = type(_BF16)
    _zarr_v3_name: ClassVar[Literal["bfloat16"]] = "bfloat16"

    @property
    def item_size(self) -> int:
        return 2

    @classmethod
    def from_native_dtype(cls, dtype) -> Self:
        if cls._check_native_dtype(dtype):
            return cls(endianness="little")
        raise DataTypeValidationError(f"Invalid data type: {dtype}. Expected {_BF16}")

    def to_native_dtype(self):
        if self.endianness != "little":
            raise DataTypeValidationError(
                "big-endian bfloat16 has no numpy representation (ml_dtypes is native-endian "
                "only); rewrite the array with a little-endian bytes codec")
        return _BF16

    @classmethod
    def _check_json_v2(cls, data) -> TypeGuard[dict]:
        return check_dtype_spec_v2(data) and data["name"] == "bfloat16" \
            and data["object_codec_id"] is None

    @classmethod
    def _check_json_v3(cls, data) -> TypeGuard[str]:
        return data == cls._zarr_v3_name

    @classmethod
    def _from_json_v2(cls, data) -> Self:
        if cls._check_json_v2(data):
            return cls()
        raise DataTypeValidationError(f"Invalid JSON for bfloat16 (zarr v2): {data!r}")

    @classmethod
    def _from_json_v3(cls, data) -> Self:
        if cls._check_json_v3(data):
            return cls()
        raise DataTypeValidationError(f"Invalid JSON for bfloat16: {data!r}, expected 'bfloat16'")

    def to_json(self, zarr_format):
        if zarr_format == 2:
            return {"name": "bfloat16", "object_codec_id": None}
        if zarr_format == 3:
            return self._zarr_v3_name
        raise ValueError(f"zarr_format must be 2 or 3, got {zarr_format}")

    def _check_scalar(self, data: object) -> bool:
        if isinstance(data, str):
            try:
                float(data)
            except ValueError:
                return False
            return True
        return isinstance(data, (int, float, np.integer, np.floating, ml_dtypes.bfloat16))

    def cast_scalar(self, data: object) -> ml_dtypes.bfloat16:
        if self._check_scalar(data):
            return _BF16.type(float(data))
        raise TypeError(f"Cannot convert {data!r} ({type(data)}) to a bfloat16 scalar")

    def default_scalar(self) -> ml_dtypes.bfloat16:
        return _BF16.type(0.0)

    def from_json_scalar(self, data, *, zarr_format) -> ml_dtypes.bfloat16:
        if isinstance(data, str) and data.startswith("0x"):
            if len(data) != 6:
                raise TypeError(f"bfloat16 hex fill value needs 4 hex digits, got {data!r}")
            return np.array([int(data, 16)], dtype=np.uint16).view(_BF16)[0]
        specials = {"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}
        if isinstance(data, str) and data in specials:
            data = specials[data]
        if isinstance(data, bool) or not self._check_scalar(data):
            raise TypeError(f"Invalid bfloat16 fill value {data!r}")
        return self.cast_scalar(data)

    def to_json_scalar(self, data, *, zarr_format):
        value = self.cast_scalar(data)
        f = float(value)
        if math.isnan(f):
            bits = _bf16_bits(value)
            return "NaN" if bits == _BF16_NAN_BITS else f"0x{bits:04x}"
        if math.isinf(f):
            return "Infinity" if f > 0 else "-Infinity"
        return f


def register_bfloat16() -> None:
    """Make zarr-python know ``"bfloat16"`` (idempotent; runs on ``import offload_engine.layout``)."""
    data_type_registry.register(BFloat16._zarr_v3_name, BFloat16)
