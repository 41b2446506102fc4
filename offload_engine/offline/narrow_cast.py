"""fp32 -> bfloat16 rounding in numpy, bit for bit torch's, so an import needs no torch.

A bf16 model's ``param`` is its fp32 master rounded to nearest even, as torch's
``Tensor.to(torch.bfloat16)`` rounds (what DeepSpeed and ZeroMuon do). For every number,
finite or infinite, that is ``(bits + 0x7FFF + ((bits >> 16) & 1)) >> 16`` of its 32 bits
(``c10::BFloat16``'s ``round_to_nearest_even``; checked against torch in the tests). torch
writes NaN in ways that depend on the code path, so a buffer holding a NaN is cast by torch
itself (imported then, once). Any other cast goes to ``casts.cast_into``.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import BFLOAT16, FLOAT32, DType
from .casts import cast_into

STEP = 1 << 20  # elements rounded at a time (bounds the uint32 temporary: 4 MiB)


def cast_bytes(dest, dest_dtype: DType, src, src_dtype: DType) -> None:
    """``dest[:] = src`` converted from ``src_dtype`` to ``dest_dtype`` as torch converts
    it. ``dest`` and ``src`` are contiguous byte buffers (memoryviews, numpy arrays) of the
    same number of elements of those types."""
    out = np.frombuffer(dest, dtype=np.uint8)
    raw = np.frombuffer(src, dtype=np.uint8)
    if (src_dtype, dest_dtype) == (FLOAT32, BFLOAT16):
        bits = raw.view(np.uint32)
        if not np.isnan(bits.view(np.float32)).any():
            round_to_bf16(out.view(np.uint16), bits)
            return
    cast_into(out, dest_dtype, raw, src_dtype)


def round_to_bf16(dest: np.ndarray, bits: np.ndarray) -> None:
    """``dest`` (uint16) = the bfloat16 bits of the fp32 numbers whose bits are ``bits``
    (uint32, no NaN), rounded to nearest even."""
    tmp = np.empty(min(STEP, len(bits)), dtype=np.uint32)
    for lo in range(0, len(bits), STEP):
        b = bits[lo:lo + STEP]
        t = tmp[:len(b)]
        np.right_shift(b, 16, out=t)
        np.bitwise_and(t, 1, out=t)
        np.add(t, 0x7FFF, out=t)
        np.add(t, b, out=t)         # no wrap: the largest finite or infinite bits + 0x8000 fit
        np.right_shift(t, 16, out=t)
        dest[lo:lo + len(b)] = t
