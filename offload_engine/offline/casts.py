"""Element types of checkpoint tensors as numpy dtypes, so that reading a checkpoint and
writing safetensors needs no torch (``import torch`` takes longer than consolidating a
267M-parameter DeepSpeed checkpoint does).

bfloat16 and the float8 types come from ml_dtypes (numpy has none). Every type here has the
same name in numpy and in torch (``np.dtype(ml_dtypes.bfloat16).name == "bfloat16"``, the
attribute ``torch.bfloat16``): that is how dtypes named in a ``torch.save`` pickle are
resolved without torch, and how a torch view is made where torch is needed after all (a
rounding cast, a source that reads through torch). Torch is imported only there.
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

# name (numpy's and torch's) -> safetensors code; complex128 has none, but torch.save writes it
_CODES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8",
    "bool": "BOOL", "complex64": "C64", "complex128": None,
}
_FROM_ML_DTYPES = {"bfloat16", "float8_e4m3fn", "float8_e5m2"}  # types numpy lacks
# floating point as torch counts it: bfloat16 and float8 are, complex is not
_FLOAT_NAMES = {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}

_BY_NAME: dict[str, np.dtype] = {
    name: np.dtype(getattr(ml_dtypes, name) if name in _FROM_ML_DTYPES else name) for name in _CODES}
SAFETENSORS_CODES: dict[np.dtype, str] = {_BY_NAME[n]: code for n, code in _CODES.items() if code}
_FLOATS = frozenset(_BY_NAME[n] for n in _FLOAT_NAMES)

BFLOAT16, FLOAT16, FLOAT32 = _BY_NAME["bfloat16"], _BY_NAME["float16"], _BY_NAME["float32"]

# Casts numpy does exactly as torch's ``Tensor.to`` does, bit for bit (checked over every
# bfloat16 bit pattern in the tests: the cast is a 16-bit shift). float16 -> float32 is not
# one: torch quiets signalling NaNs, numpy keeps them (1022 of the 65536 patterns differ).
_NUMPY_CASTS = frozenset({(BFLOAT16, FLOAT32)})


def dtype_named(name: str) -> np.dtype | None:
    """The dtype called ``name`` in torch and numpy ("float32", "bfloat16", ...), else None."""
    return _BY_NAME.get(name)


def as_dtype(dtype) -> np.dtype:
    """``dtype`` as a numpy dtype: a numpy dtype or scalar type, a name ("bfloat16"), or a
    torch dtype (converted by name; torch is not imported for it: a process that never
    imported torch holds no torch dtype). ValueError for one outside the table above."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        name = dtype
    else:
        name = np.dtype(dtype).name
    found = _BY_NAME.get(name)
    if found is None:
        raise ValueError(f"dtype {dtype} is not supported here; supported: {', '.join(_BY_NAME)}")
    return found


def is_float(dtype: np.dtype) -> bool:
    """Whether torch calls ``dtype`` floating point (bfloat16 and float8 yes, complex no)."""
    return dtype in _FLOATS


def to_torch(dtype: np.dtype):
    """The torch dtype of the same name (imports torch)."""
    import torch

    return getattr(torch, dtype.name)


def as_torch_view(array):
    """A torch tensor over the memory of a 1-D numpy ``array`` (bfloat16 included), of the
    same dtype; a torch tensor is returned as it is. Imports torch."""
    import torch

    if isinstance(array, torch.Tensor):
        return array
    if array.size == 0:  # nothing to share, and an empty view cannot be reinterpreted
        return torch.empty(0, dtype=to_torch(array.dtype))
    return torch.from_numpy(array.reshape(-1).view(np.uint8)).view(to_torch(array.dtype))


def cast_into(dest: np.ndarray, src: np.ndarray) -> None:
    """``dest[:] = src`` converted to ``dest``'s dtype, bit for bit as torch's ``Tensor.to``
    converts (round to nearest even when narrowing). Casts numpy does identically run in
    numpy; the others go through torch, imported on first need."""
    if (src.dtype, dest.dtype) in _NUMPY_CASTS:
        np.copyto(dest, src, casting="unsafe")
        return
    as_torch_view(dest).copy_(as_torch_view(src))
