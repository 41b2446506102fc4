"""CRC-32C of chunk files, computed and verified in bounded memory.

CRC-32C (Castagnoli) is the checksum zarr v3's ``crc32c`` codec and the sharding index use;
google-crc32c computes it with the CPU's CRC instruction (GB/s), so verifying a checkpoint
costs about as much as reading it.
"""

from __future__ import annotations

import os

import google_crc32c

from ..io import TruncatedFileError

PIECE = 8 << 20  # bytes read at a time


def file_crc32c(path: str) -> int:
    """CRC-32C of the whole file at ``path`` (unsigned 32-bit)."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            piece = f.read(PIECE)  # bytes: what the C extension takes
            if not piece:
                return crc
            crc = google_crc32c.extend(crc, piece)


class ChecksumError(ValueError):
    """A chunk file whose bytes do not match the checksum recorded at save time."""


class ChunkVerifier:
    """Verifies each chunk file once, on first use, against ``checksums[array][i]``."""

    def __init__(self, gen: str, checksums: dict):
        self.gen = gen
        self.checksums = checksums
        self._done: set[tuple[str, int]] = set()

    def verify(self, array: str, flat, start: int, stop: int) -> None:
        """Check every chunk of ``flat`` (array ``array``) holding elements [start, stop)."""
        if stop <= start:
            return
        for i in range(start // flat.chunk_elems, (stop - 1) // flat.chunk_elems + 1):
            if (array, i) in self._done:
                continue
            path = flat.chunk_path(i)
            try:
                expected = self.checksums[array][i]
            except (KeyError, IndexError):
                raise ChecksumError(f"{path}: the manifest records no checksum for this chunk") from None
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                raise ChecksumError(f"{path}: chunk file missing") from None
            if size != flat.chunk_bytes:
                raise TruncatedFileError(0, "verify", path, 0, flat.chunk_bytes,
                                         detail=f"chunk file has {size} bytes, expected {flat.chunk_bytes}")
            actual = file_crc32c(path)
            if actual != expected:
                raise ChecksumError(f"{path}: checksum mismatch (crc32c {actual:#010x}, manifest "
                                    f"says {expected:#010x}): the file is corrupt")
            self._done.add((array, i))
