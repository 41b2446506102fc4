"""Write an array's bytes in order through a few page-aligned staging blocks.

O_DIRECT needs the memory address, the file offset and the length of a request to be
multiples of 4096 bytes; anything else goes through the page cache (a kernel copy, then
writeback and invalidation: measured, that was most of a checkpoint's CPU time). Packed
parameters start at any byte, and a torch tensor is only 64-byte aligned, so they are
copied (memcpy, ~8 GB/s) into aligned blocks that are written whole, a few in flight.
The same path takes bytes from a GPU (one copy into the block, no separate staging).
"""

from __future__ import annotations

import math

import torch

from ..io import IOFuture
from ..io.align import ALIGN, aligned_host_buffer
from ..layout import FlatArray
from .checksums import SequentialChunkCrc

BLOCK_BYTES = 8 << 20  # bytes per staged write
BLOCKS = 4             # staging blocks: one filling while the others are written


def block_bytes_for(chunk_bytes: int) -> int:
    """The largest block (bytes, a multiple of 4096, at most BLOCK_BYTES) that never
    straddles two chunk files of ``chunk_bytes``."""
    return chunk_bytes if chunk_bytes <= BLOCK_BYTES else math.gcd(chunk_bytes, BLOCK_BYTES)


class StagingBlocks:
    """``count`` page-aligned host buffers of ``nbytes`` each (bytes); reused by every
    StagedWriter that runs on one thread."""

    def __init__(self, nbytes: int, count: int = BLOCKS):
        self.nbytes = nbytes
        self.buffers = [aligned_host_buffer(nbytes) for _ in range(count)]  # (mmap, uint8 tensor)


class StagedWriter:
    """Writes array ``arr`` in order from byte ``start`` (a chunk boundary): ``add`` bytes,
    then ``finish``. The chunk checksums (``checksums``, a SequentialChunkCrc over what this
    writer writes) are taken as blocks go out.
    """

    def __init__(self, arr: FlatArray, staging: StagingBlocks, checksums: SequentialChunkCrc,
                 start: int = 0):
        if arr.chunk_bytes % staging.nbytes or start % arr.chunk_bytes:
            raise ValueError(f"{arr.path}: staging blocks of {staging.nbytes} bytes from byte "
                             f"{start} straddle its {arr.chunk_bytes}-byte chunks")
        self.arr = arr
        self.staging = staging
        self.checksums = checksums
        self.pos = start      # array bytes already handed to a write
        self.fill = 0         # bytes in the current block
        self.cur = 0          # which staging block is filling
        self.inflight: list[list[IOFuture]] = [[] for _ in staging.buffers]

    def add(self, src: torch.Tensor) -> None:
        """Append the bytes of ``src`` (a contiguous tensor of the array's dtype, on any
        device)."""
        data = src.detach().reshape(-1).view(torch.uint8)
        taken, total = 0, data.numel()
        while taken < total:
            block = self._filling()
            n = min(self.staging.nbytes - self.fill, total - taken)
            block[self.fill:self.fill + n].copy_(data[taken:taken + n])
            if data.device.type == "cuda":
                torch.cuda.current_stream(data.device).synchronize()
            self.fill += n
            taken += n
            if self.fill == self.staging.nbytes:
                self._write_block()

    def finish(self) -> None:
        """Write the last, partial block and wait for every write."""
        self._write_block()
        for futures in self.inflight:
            for f in futures:
                f.result()
            futures.clear()

    def _filling(self) -> torch.Tensor:
        """The block being filled, once its previous write has ended."""
        for f in self.inflight[self.cur]:
            f.result()
        self.inflight[self.cur].clear()
        return self.staging.buffers[self.cur][1]

    def _write_block(self) -> None:
        if not self.fill:
            return
        region, block = self.staging.buffers[self.cur]
        self.checksums.add(block[:self.fill])
        view = memoryview(region)
        item = self.arr.itemsize
        first = self.pos // item
        aligned = self.fill // ALIGN * ALIGN  # the whole block but at the array's very end
        pieces = [(0, aligned), (aligned, self.fill)]
        self.inflight[self.cur] = [
            self.arr.write_from(first + lo // item, first + hi // item, view[lo:hi])
            for lo, hi in pieces if hi > lo]
        self.pos += self.fill
        self.fill = 0
        self.cur = (self.cur + 1) % len(self.staging.buffers)
