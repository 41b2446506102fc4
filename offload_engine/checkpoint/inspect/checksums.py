"""crc32c of chunk files, computed incrementally over the windows they are read in.

google-crc32c (a dependency of zarr-python's own crc32c codec) takes numpy arrays without
a copy; its hardware path runs at several GB/s, above the disk.
"""

from __future__ import annotations

import torch

from .errors import InspectError


def _lib():
    try:
        import google_crc32c
    except ImportError:  # pragma: no cover - zarr-python depends on it
        raise InspectError("verifying checkpoint checksums needs the google-crc32c package "
                           "(pip install google-crc32c)") from None
    return google_crc32c


def crc32c_extend(crc: int, data: torch.Tensor) -> int:
    """``crc`` extended by the bytes of ``data`` (a contiguous CPU uint8 tensor)."""
    if not data.numel():
        return crc
    return _lib().extend(crc, data.numpy())


def crc32c(data: bytes) -> int:
    return _lib().value(data)
