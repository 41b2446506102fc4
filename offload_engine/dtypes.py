"""Element types: the one table that every layer uses for torch, numpy, zarr and safetensors.

A tensor's element type is known here by its name, which is the same in torch, numpy (with
ml_dtypes for the types numpy lacks) and zarr v3's ``data_type``: ``"float32"``,
``"bfloat16"``. Each entry also carries its size in bytes, its kind, its safetensors code
and the short names people type (``fp32``, ``bf16``).

Importing this module imports nothing heavy: ``import torch`` takes seconds and ``import
ml_dtypes`` about one on a slow machine, longer than a planning or consolidation command
takes in all. A :class:`DType` gives its torch dtype (``.torch``) or numpy dtype
(``.numpy``) on request, importing torch, or numpy plus ml_dtypes for bfloat16 and float8,
only then. Code that only moves bytes uses ``.itemsize`` and ``.raw_numpy`` (an unsigned
integer type of the same size, which plain numpy has for every entry).

Byte order: stored elements are little endian (zarr ``bytes`` codec ``endian: little``,
safetensors, ``torch.save``); every host torch supports is little endian, and the layers
that move raw bytes into tensors check it where they do so.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from .errors import InputError


@dataclass(frozen=True)
class DType:
    """One element type. ``name`` is torch's, numpy's and zarr's name for it."""

    name: str
    itemsize: int                   # bytes per element
    kind: str                       # "bool", "int", "uint", "float" or "complex"
    safetensors: str | None         # safetensors dtype code, None where it has none
    short: tuple[str, ...] = ()     # other spellings accepted on the command line
    zarr: bool = True               # a zarr v3 data type our arrays may hold

    @property
    def is_float(self) -> bool:
        """Floating point as torch counts it: bfloat16 and float8 are, complex is not."""
        return self.kind == "float"

    @property
    def torch(self):
        """The torch dtype (imports torch)."""
        import torch

        return getattr(torch, self.name)

    @property
    def numpy(self):
        """The numpy dtype, little endian; bfloat16 and float8 come from ml_dtypes
        (imported here, and only for them)."""
        import numpy as np

        if self.name in _FROM_ML_DTYPES:
            import ml_dtypes

            return np.dtype(getattr(ml_dtypes, self.name))
        return np.dtype(self.name).newbyteorder("<")

    @property
    def raw_numpy(self):
        """An unsigned integer numpy dtype of the same size: a view of the same bytes that
        needs no ml_dtypes (bool and complex types have their own numpy type and keep it)."""
        import numpy as np

        if self.kind in ("bool", "complex"):
            return np.dtype(self.name)
        return np.dtype(f"<u{self.itemsize}")

    def __str__(self) -> str:
        return self.name


_TABLE = (
    DType("bool", 1, "bool", "BOOL"),
    DType("uint8", 1, "uint", "U8", ("u8",)),
    DType("int8", 1, "int", "I8", ("i8",)),
    DType("uint16", 2, "uint", "U16", ("u16",)),
    DType("int16", 2, "int", "I16", ("i16",)),
    DType("uint32", 4, "uint", "U32", ("u32",)),
    DType("int32", 4, "int", "I32", ("i32",)),
    DType("uint64", 8, "uint", "U64", ("u64",)),
    DType("int64", 8, "int", "I64", ("i64",)),
    DType("float16", 2, "float", "F16", ("fp16", "f16", "half")),
    DType("bfloat16", 2, "float", "BF16", ("bf16",)),
    DType("float32", 4, "float", "F32", ("fp32", "f32", "float")),
    DType("float64", 8, "float", "F64", ("fp64", "f64", "double")),
    DType("float8_e4m3fn", 1, "float", "F8_E4M3", (), zarr=False),
    DType("float8_e5m2", 1, "float", "F8_E5M2", (), zarr=False),
    DType("complex64", 8, "complex", "C64", (), zarr=False),
    # torch.save writes it; safetensors has no code for it
    DType("complex128", 16, "complex", None, (), zarr=False),
)
_FROM_ML_DTYPES = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2"})  # numpy lacks them

BY_NAME: dict[str, DType] = {t.name: t for t in _TABLE}
_BY_SPELLING: dict[str, DType] = {**{s: t for t in _TABLE for s in t.short}, **BY_NAME}
_BY_SAFETENSORS: dict[str, DType] = {t.safetensors: t for t in _TABLE if t.safetensors}

FLOAT16, BFLOAT16, FLOAT32 = BY_NAME["float16"], BY_NAME["bfloat16"], BY_NAME["float32"]
ZARR_NAMES = tuple(t.name for t in _TABLE if t.zarr)


def dtype(value) -> DType:
    """The entry for ``value``: a DType, a name or short name (``"bfloat16"``, ``"bf16"``),
    a torch dtype or a numpy dtype (or numpy scalar type). Neither torch nor numpy is
    imported to convert: a process that never imported them holds none of their dtypes.
    ValueError for a type outside the table."""
    if isinstance(value, DType):
        return value
    if isinstance(value, str):
        found = _BY_SPELLING.get(value)
    else:
        found = BY_NAME.get(_foreign_name(value))
    if found is None:
        raise InputError(f"dtype {value!r} is not supported here; supported: "
                         f"{', '.join(BY_NAME)}")
    return found


def lookup(value) -> DType | None:
    """``dtype(value)``, or None for a type outside the table (or not a type at all)."""
    try:
        return dtype(value)
    except (ValueError, TypeError):
        return None


def from_safetensors(code: str) -> DType:
    """The entry for a safetensors dtype code (``"BF16"``); ValueError when unknown."""
    found = _BY_SAFETENSORS.get(code) if isinstance(code, str) else None
    if found is None:
        raise InputError(f"safetensors dtype {code!r} is not supported here; supported: "
                         f"{', '.join(_BY_SAFETENSORS)}")
    return found


def zarr_dtype(name) -> DType:
    """The entry for a zarr v3 ``data_type`` our arrays may hold; ValueError otherwise."""
    found = BY_NAME.get(name) if isinstance(name, str) else None
    if found is None or not found.zarr:
        raise InputError(f"zarr data type {name!r} is not supported (supported: "
                         f"{', '.join(ZARR_NAMES)})")
    return found


def itemsize(value) -> int:
    """Bytes per element of ``value`` (anything ``dtype`` takes)."""
    return dtype(value).itemsize


def _foreign_name(value) -> str | None:
    if value is None:  # numpy would read None as float64
        return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            found = np.dtype(value)
        except TypeError:
            return None
        # the table's types are little endian: a big-endian dtype is not one of them
        return None if found.byteorder == ">" else found.name
    return None
