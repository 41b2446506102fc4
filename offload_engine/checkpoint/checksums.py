"""CRC-32C of chunk files: recorded at save, verified by every reader (load, consolidate,
inspect, diff, export), in bounded memory.

A checkpoint records, for every array, one entry per chunk in chunk order: the chunk
file's crc32c (unsigned 32-bit), or ``None`` (JSON ``null``) where the chunk file does not
exist (a chunk never written reads as the fill value). So entry ``i`` is always chunk
``i``, and a chunk file that appears or disappears after the save is detected.

CRC-32C (Castagnoli) is the checksum zarr v3's ``crc32c`` codec and the sharding index use;
google-crc32c computes it with the CPU's CRC instruction (GB/s), so verifying a checkpoint
costs about as much as reading it.
"""

from __future__ import annotations

import os

import google_crc32c

from ..io import TruncatedFileError

PIECE = 8 << 20  # bytes read at a time


class ChecksumError(ValueError):
    """A chunk file that does not match what the checkpoint recorded at save time: other
    bytes, missing although it had data, or present although it had none."""


def file_crc32c(path: str) -> int:
    """CRC-32C of the whole file at ``path`` (unsigned 32-bit)."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            piece = f.read(PIECE)  # bytes: what the C extension takes
            if not piece:
                return crc
            crc = google_crc32c.extend(crc, piece)


def crc32c_extend(crc: int, data) -> int:
    """``crc`` extended by the bytes of ``data`` (a contiguous CPU uint8 tensor; no copy)."""
    if not data.numel():
        return crc
    return google_crc32c.extend(crc, data.numpy())


def chunk_checksums(flat) -> list[int | None]:
    """What a checkpoint records for the FlatArray ``flat``: the crc32c of every chunk
    file in chunk order, ``None`` for a chunk file that does not exist."""
    out: list[int | None] = []
    for i in range(flat.nchunks):
        path = flat.chunk_path(i)
        try:
            out.append(file_crc32c(path))
        except FileNotFoundError:
            out.append(None)
    return out


def mismatch(path: str, actual: int, expected: int, what: str = "") -> ChecksumError:
    """The error for a chunk file whose crc32c is not the recorded one; ``what`` names the
    chunk (e.g. "chunk 0 of array rank1/master")."""
    return ChecksumError(f"{path}: checksum mismatch: crc32c is {actual:#010x}, the checkpoint "
                         f"manifest records {expected:#010x}" + (f" for {what}" if what else "")
                         + "; the file is corrupt")


def missing(path: str) -> ChecksumError:
    """The error for a chunk file that had data at save time and is gone."""
    return ChecksumError(f"{path}: chunk file missing, but the checkpoint manifest records "
                         f"its crc32c (deleted or never written)")


def unexpected(path: str) -> ChecksumError:
    """The error for a chunk file that exists although none existed at save time."""
    return ChecksumError(f"{path}: chunk file present, but the checkpoint manifest records "
                         f"it as absent (written after the save?)")


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
            recorded = self.checksums.get(array)
            if recorded is None or i >= len(recorded):
                raise ChecksumError(f"{path}: the manifest records no checksum for this chunk")
            expected = recorded[i]
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                if expected is None:  # absent at save time too: reads as the fill value
                    self._done.add((array, i))
                    continue
                raise missing(path) from None
            if expected is None:
                raise unexpected(path)
            if size != flat.chunk_bytes:
                raise TruncatedFileError(0, "verify", path, 0, flat.chunk_bytes,
                                         detail=f"chunk file has {size} bytes, expected {flat.chunk_bytes}")
            actual = file_crc32c(path)
            if actual != expected:
                raise mismatch(path, actual, expected)
            self._done.add((array, i))
