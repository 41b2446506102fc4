"""The import's data path: the source's bytes read straight into page-aligned blocks, then
written from them.

Each target array is written in element order through a ring of ``count`` blocks of
``block_bytes`` (page-aligned, from one BufferPool): the source's reads scatter into the
block itself, the block goes to its chunk files with O_DIRECT while the next block is
read, and its CRC-32C is taken as it goes out. No window tensors, no copy from a window
into a staging block, no torch: the memory is the blocks, whatever the size of the
checkpoint or its number of tensors, and a byte is moved by the kernel twice (read, write)
and touched by the CPU once (its checksum).

A piece stored in another dtype than it is written in (a bf16 model's ``param``, from the
fp32 master) is read into a scratch buffer of the stored dtype and cast into the block
(``narrow_cast.py``).
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from ..io import BufferPool, IOFuture
from ..layout import FlatArray
from ..layout.checksums import SequentialChunkCrc
from ..formats.source import ReadRequest
from .import_layout import Piece
from .narrow_cast import cast_bytes

MAX_PIECES = 4096  # tensor pieces per read call: a window of tiny experts stays small

# read(requests): fill every ReadRequest (the source's ``read``)
Read = Callable[[list], None]


class Blocks:
    """``count`` page-aligned blocks of ``block_bytes``, used in turn: ``take`` waits for
    the write that last used the next block. ``close`` when done."""

    def __init__(self, block_bytes: int, count: int):
        self.block_bytes = block_bytes
        self._pool = BufferPool(block_bytes * count, pin=False)
        self._views = [self._pool.acquire(block_bytes).memoryview() for _ in range(count)]
        self._writes: list[IOFuture | None] = [None] * count
        self._next = 0

    def take(self) -> tuple[int, memoryview]:
        """The next block, free: ``(its number, its bytes)``."""
        i = self._next
        self._next = (i + 1) % len(self._views)
        self._wait(i)
        return i, self._views[i]

    def writing(self, i: int, future: IOFuture) -> None:
        """Block ``i`` is being written by ``future``: not reused before it completes."""
        self._writes[i] = future

    def drain(self) -> None:
        """Wait for every write (its error, if any, is raised here)."""
        for i in range(len(self._writes)):
            self._wait(i)

    def _wait(self, i: int) -> None:
        future, self._writes[i] = self._writes[i], None
        if future is not None:
            future.result()

    def close(self) -> None:
        """Wait for the writes in flight (errors ignored: the caller is failing or done),
        then free the blocks."""
        for f in self._writes:
            if f is not None:
                try:
                    f.result()
                except BaseException:
                    pass
        self._writes = [None] * len(self._writes)
        self._views = []
        self._pool.close()


class _BlockFill:
    """The reads (and casts) that fill one block, in batches of at most ``batch_bytes``
    read from the source."""

    def __init__(self, block: memoryview, itemsize: int, batch_bytes: int, read: Read,
                 scratch: "_Scratch"):
        self.block = block
        self.itemsize = itemsize
        self.batch_bytes = batch_bytes
        self.read = read
        self.scratch = scratch
        self.requests: list[ReadRequest] = []
        self.batched = 0
        self.casts: list[list] = []   # [first element in the block, elements, stored, dtype]

    def add(self, piece: Piece, lo: int, n: int, at: int) -> None:
        """Elements ``[lo, lo + n)`` of ``piece`` go to elements ``[at, at + n)`` of the
        block."""
        state = piece.state
        if state.stored == state.dtype:
            dest = self.block[at * self.itemsize:(at + n) * self.itemsize]
        else:
            size = state.stored.itemsize
            dest = self.scratch.view(len(self.block) // self.itemsize * size)[at * size:(at + n) * size]
            last = self.casts[-1] if self.casts else None
            if last is not None and last[0] + last[1] == at and last[2:] == [state.stored, state.dtype]:
                last[1] += n
            else:
                self.casts.append([at, n, state.stored, state.dtype])
        self.requests.append(ReadRequest(piece.plan.name, piece.first + lo, dest, state.source))
        self.batched += n * state.stored.itemsize
        if self.batched >= self.batch_bytes or len(self.requests) >= MAX_PIECES:
            self._read()

    def _read(self) -> None:
        if self.requests:
            self.read(self.requests)
        self.requests, self.batched = [], 0

    def finish(self) -> None:
        """Read what is left, then cast what was read in another dtype into the block."""
        self._read()
        for at, n, stored, dtype in self.casts:
            size = stored.itemsize
            src = self.scratch.view(len(self.block) // self.itemsize * size)[at * size:(at + n) * size]
            cast_bytes(self.block[at * self.itemsize:(at + n) * self.itemsize], dtype, src, stored)


class _Scratch:
    """One reusable byte buffer for pieces read in another dtype (allocated on first use)."""

    def __init__(self):
        self._buf: np.ndarray | None = None

    def view(self, nbytes: int) -> memoryview:
        if self._buf is None or len(self._buf) < nbytes:
            self._buf = np.empty(nbytes, dtype=np.uint8)
        return memoryview(self._buf)[:nbytes]


def write_array(arr: FlatArray, pieces: Iterator[Piece], read: Read, blocks: Blocks,
                crcs: SequentialChunkCrc, batch_bytes: int) -> int:
    """Write every element of ``arr`` from ``pieces`` (in element order), block by block;
    returns the bytes written. The writes may still be in flight (``blocks.drain``)."""
    itemsize = arr.itemsize
    per_block = blocks.block_bytes // itemsize
    scratch = _Scratch()
    pieces = iter(pieces)
    carry: tuple[Piece, int] | None = None   # a piece begun in the previous block
    pos = 0
    while pos < arr.numel:
        index, block = blocks.take()
        n = min(per_block, arr.numel - pos)
        fill = _BlockFill(block, itemsize, batch_bytes, read, scratch)
        at = 0
        while at < n:
            piece, done = carry if carry is not None else (_next(pieces, arr, pos + at), 0)
            take = min(piece.count - done, n - at)
            fill.add(piece, done, take, at)
            at += take
            carry = (piece, done + take) if done + take < piece.count else None
        fill.finish()
        data = block[:n * itemsize]
        blocks.writing(index, arr.write_from(pos, pos + n, data))
        crcs.add(data)  # while the write runs
        pos += n
    if carry is not None or any(p.count for p in pieces):
        raise AssertionError(f"{arr.path}: the tensors planned for it hold more than its "
                             f"{arr.numel} elements")
    return arr.numel * itemsize


def _next(pieces: Iterator[Piece], arr: FlatArray, at: int) -> Piece:
    """The next piece of ``arr`` holding elements (pieces of no elements skipped)."""
    for piece in pieces:
        if piece.count:
            return piece
    raise AssertionError(f"{arr.path}: the tensors planned for it end at element {at} of "
                         f"{arr.numel}")
