"""Casts between element types, bit for bit as torch's ``Tensor.to`` casts, over raw buffers.

The offline tools move tensors as bytes (numpy arrays of ``DType.raw_numpy``), so reading
a checkpoint and writing safetensors needs neither torch nor ml_dtypes (their imports take
longer than consolidating a 267M-parameter checkpoint). A cast is done here:

- bfloat16 -> float32 in numpy: it is a 16-bit shift of the bits (checked against torch
  over every bfloat16 bit pattern in the tests, NaNs included);
- any other cast through torch, imported on first need (``--dtype bf16`` from fp32 masters
  rounds to nearest even; float16 -> float32 quiets signalling NaNs, which numpy does not).
"""

from __future__ import annotations

import numpy as np

from ..dtypes import BFLOAT16, FLOAT32, DType


def cast_into(dest, dest_dtype: DType, src, src_dtype: DType) -> None:
    """``dest[:] = src`` converted from ``src_dtype`` to ``dest_dtype`` (round to nearest
    even when narrowing), as torch converts. ``dest`` and ``src`` are 1-D numpy arrays (or
    torch tensors) holding the same number of elements of those types, in any view."""
    if dest_dtype == src_dtype:
        np.copyto(_bytes(dest), _bytes(src))
        return
    if (src_dtype, dest_dtype) == (BFLOAT16, FLOAT32):
        wide = _raw(dest, FLOAT32)  # uint32 bits; widened and shifted in place, no temporary
        np.copyto(wide, _raw(src, BFLOAT16))
        np.left_shift(wide, 16, out=wide)
        return
    as_torch_view(dest, dest_dtype).copy_(as_torch_view(src, src_dtype))


def as_torch_view(array, dtype: DType):
    """A torch tensor of ``dtype`` over the memory of a 1-D numpy ``array`` (any view of
    the same bytes); a torch tensor is returned as it is. Imports torch."""
    import torch

    if isinstance(array, torch.Tensor):
        return array
    raw = _bytes(array)
    if raw.size == 0:  # nothing to share, and an empty view cannot be reinterpreted
        return torch.empty(0, dtype=dtype.torch)
    return torch.from_numpy(raw).view(dtype.torch)


def _bytes(array) -> np.ndarray:
    """The bytes of a contiguous 1-D array as a uint8 numpy array (no copy)."""
    if isinstance(array, np.ndarray):
        return array.reshape(-1).view(np.uint8)
    return array.reshape(-1).view(__import__("torch").uint8).numpy()


def _raw(array, dtype: DType) -> np.ndarray:
    return _bytes(array).view(dtype.raw_numpy)
