"""zarr-python's ``"bfloat16"`` data type, so that ``zarr.open_array`` reads (and writes) the
engine's bfloat16 arrays.

zarr-python (3.1) has no ``bfloat16``; :class:`BFloat16` is the registered extension type
``"bfloat16"`` (zarr-extensions ``data-types/bfloat16``), backed by ``ml_dtypes.bfloat16``.
It mixes in ``HasEndianness`` because without it zarr-python writes a ``bytes`` codec with
no ``endian``, which tensorstore refuses for 2-byte types.

zarr-python finds it through the package's entry point (``zarr.data_type`` in
pyproject.toml): the engine itself never imports zarr or ml_dtypes to register it, so a
command that reads our arrays through its own chunk I/O does not pay for either (ml_dtypes
alone takes about a second to import on a slow machine). ``register_bfloat16()`` registers
it by hand, for an installation whose entry points were not refreshed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal, Self, TypeGuard

import ml_dtypes
import numpy as np
from zarr.core.dtype.common import (DataTypeValidationError, HasEndianness, HasItemSize,
                                    check_dtype_spec_v2)
from zarr.core.dtype.wrapper import ZDType
from zarr.dtype import data_type_registry
from ..errors import InputError

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
        raise InputError(f"zarr_format must be 2 or 3, got {zarr_format}")

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
    """Make zarr-python know ``"bfloat16"`` (idempotent; the entry point does it otherwise)."""
    data_type_registry.register(BFloat16._zarr_v3_name, BFloat16)
