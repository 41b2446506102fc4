"""CRC-32C of chunk files: recorded at save (checkpoint/), verified by every reader
(formats/ours: load, consolidate, inspect, diff, export), in bounded memory.

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
import numpy as np

from ..io.align import as_byte_view
from ..units import MiB
from ..errors import InputError

PIECE = 8 * MiB  # bytes of zeros checksummed at a time


class ChecksumError(InputError):
    """A chunk file that does not match what the checkpoint recorded at save time: other
    bytes, missing although it had data, or present although it had none."""


def crc32c_extend(crc: int, data) -> int:
    """``crc`` extended by the bytes of ``data`` (a contiguous CPU tensor, numpy array or
    buffer; no copy)."""
    view = as_byte_view(data)
    if not len(view):
        return crc
    # the C extension takes a numpy array over the bytes (not a writable memoryview)
    return google_crc32c.extend(crc, np.frombuffer(view, dtype=np.uint8))


def padded_crc32c(data, chunk_bytes: int) -> int:
    """CRC-32C of a chunk file that holds the bytes of ``data`` (a contiguous CPU tensor,
    array or buffer) followed by zeros up to ``chunk_bytes`` (an edge chunk's padding): what
    a writer records from memory instead of reading its chunk back."""
    view = as_byte_view(data)
    return crc32c_extend_zeros(crc32c_extend(0, view), chunk_bytes - len(view))


_zero_piece = None  # a numpy array of PIECE zero bytes, made on first use (readers never need it)


def crc32c_extend_zeros(crc: int, n: int) -> int:
    """``crc`` extended by ``n`` zero bytes (a chunk file's padding)."""
    global _zero_piece
    if _zero_piece is None:
        _zero_piece = np.zeros(PIECE, dtype=np.uint8)
    while n > 0:
        piece = min(n, PIECE)
        crc = google_crc32c.extend(crc, _zero_piece[:piece])
        n -= piece
    return crc


class SequentialChunkCrc:
    """The chunk checksums of an array whose bytes are written in order from byte 0 (a
    packed array of parameters): ``add`` each piece as it is written, ``finish`` pads the
    last chunk with zeros, as the file is."""

    def __init__(self, chunk_bytes: int, total_bytes: int):
        self.chunk_bytes = chunk_bytes
        self.total_bytes = total_bytes
        self.pos = 0
        self.crc = 0
        self.done: list[int] = []

    def add(self, data) -> None:
        """Extend by ``data`` (a contiguous CPU tensor, array or buffer), the next bytes of
        the array."""
        view = as_byte_view(data)
        taken = 0
        while taken < len(view):
            room = self.chunk_bytes - self.pos % self.chunk_bytes
            piece = view[taken:taken + room]
            self.crc = crc32c_extend(self.crc, piece)
            self.pos += len(piece)
            taken += len(piece)
            if self.pos % self.chunk_bytes == 0:
                self.done.append(self.crc)
                self.crc = 0

    def finish(self) -> list[int]:
        if self.pos != self.total_bytes:
            raise AssertionError(f"{self.pos} of {self.total_bytes} bytes were checksummed")
        if self.pos % self.chunk_bytes:
            self.done.append(crc32c_extend_zeros(self.crc, self.chunk_bytes - self.pos % self.chunk_bytes))
        return self.done


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
