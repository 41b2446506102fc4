"""Write an array's bytes in order through a few page-aligned staging blocks.

O_DIRECT needs the memory address, the file offset and the length of a request to be
multiples of 4096 bytes; anything else goes through the page cache (a kernel copy, then
writeback and invalidation: measured, that was most of a checkpoint's CPU time). Packed
parameters start at any byte, and a torch tensor is only 64-byte aligned, so they are
copied (memcpy, ~8 GB/s) into aligned blocks that are written whole, a few in flight.
The same path takes bytes from a GPU (one copy into the block, no separate staging).
"""

from __future__ import annotations

import torch

from ..io import BufferPool, IOFuture
from ..io.align import ALIGN
from ..layout import FlatArray
from ..layout.checksums import SequentialChunkCrc
from ..units import MiB
from ..errors import InputError

BLOCK_BYTES = 8 * MiB  # bytes per staged write
BLOCKS = 4             # staging blocks: one filling while the others are written


class StagingBlocks:
    """``count`` page-aligned host buffers of ``nbytes`` each (bytes) from one BufferPool
    (CUDA-pinned where CUDA is available, so GPU copies into them are DMA); reused by one
    StagedWriter after another, never two at once (threads sharing them take a lock). Pages
    are committed as they are first written, so a small checkpoint uses little of them.
    ``close`` when done."""

    def __init__(self, nbytes: int = BLOCK_BYTES, count: int = BLOCKS):
        self.nbytes = nbytes
        self._pool = BufferPool(count * nbytes)
        blocks = [self._pool.acquire(nbytes) for _ in range(count)]
        self.buffers = [(b.memoryview(), b.bytes) for b in blocks]  # (bytes view, uint8 tensor)

    def close(self) -> None:
        self.buffers = []
        self._pool.close()


class StagedWriter:
    """Writes array ``arr`` in order from byte ``start`` (a chunk boundary): ``add`` bytes,
    then ``finish``. The chunk checksums (``checksums``, a SequentialChunkCrc over what this
    writer writes) are taken as blocks go out.
    """

    def __init__(self, arr: FlatArray, staging: StagingBlocks, checksums: SequentialChunkCrc,
                 start: int = 0):
        if start % ALIGN or staging.nbytes % ALIGN:
            # a block may span two chunk files: both pieces stay page-aligned, since chunk
            # files are whole pages
            raise InputError(f"{arr.path}: staged writes start at byte {start} with blocks of "
                             f"{staging.nbytes} bytes; both must be multiples of {ALIGN}")
        self.arr = arr
        self.staging = staging
        self.checksums = checksums
        self.pos = start      # array bytes already handed to a write
        self.fill = 0         # bytes in the current block
        self.parts: list[torch.Tensor] = []  # uint8 views of what the current block will hold
        self.cur = 0          # which staging block is filling
        self.inflight: list[IOFuture | None] = [None for _ in staging.buffers]

    def add(self, sources: list[torch.Tensor]) -> None:
        """Append the bytes of each tensor of ``sources`` (contiguous, the array's dtype, on
        any device), in order.

        The bytes are gathered into a block when it is written, with one ``torch.cat`` for
        the whole block rather than a copy per tensor: while the training thread holds the
        GIL, each call that releases it (a copy, a wait) can cost this thread a switch
        interval (5 ms) to get it back. The tensors must not change until written.
        """
        for src in sources:
            data = src.detach().reshape(-1).view(torch.uint8)
            taken, total = 0, data.numel()
            while taken < total:
                n = min(self.staging.nbytes - self.fill, total - taken)
                self.parts.append(data[taken:taken + n])
                self.fill += n
                taken += n
                if self.fill == self.staging.nbytes:
                    self._write_block()

    def finish(self) -> None:
        """Write the last, partial block and wait for every write."""
        self._write_block()
        for i, f in enumerate(self.inflight):
            if f is not None:
                f.result()
            self.inflight[i] = None

    def _write_block(self) -> None:
        """Copy the pending parts into the current block (once its previous write ended),
        start writing it, and checksum it while the write runs."""
        if not self.fill:
            return
        view, block = self.staging.buffers[self.cur]
        if self.inflight[self.cur] is not None:
            self.inflight[self.cur].result()
        _gather(self.parts, block[:self.fill])
        self.parts = []
        item = self.arr.itemsize
        first = self.pos // item
        # O_DIRECT: the whole block but a sub-page tail at the array's very end
        self.inflight[self.cur] = self.arr.write_from(first, first + self.fill // item, view)
        self.checksums.add(block[:self.fill])
        self.pos += self.fill
        self.fill = 0
        self.cur = (self.cur + 1) % len(self.staging.buffers)


def _gather(parts: list[torch.Tensor], dest: torch.Tensor) -> None:
    """Copy the uint8 tensors ``parts`` back to back into ``dest`` (a CPU uint8 tensor)."""
    if len(parts) > 1 and all(p.device.type == "cpu" for p in parts):
        torch.cat(parts, out=dest)
        return
    pos = 0
    for p in parts:
        # from a GPU: queued on its current stream (dest is pinned), not waited for one by one
        dest[pos:pos + p.numel()].copy_(p, non_blocking=True)
        pos += p.numel()
    for device in {p.device for p in parts if p.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()  # landed before the block is written
