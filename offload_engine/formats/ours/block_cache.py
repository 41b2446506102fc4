"""Cached byte ranges of chunk files, with a read-ahead that grows on sequential reads.

``RangeReader`` serves reads of element ranges; a checkpoint of many small tensors asks for
hundreds of thousands of ranges of a few hundred bytes each, one after another in storage
order. Reading each one from the disk on its own costs a system call and a wake-up of the
I/O threads per tensor (at 100,000 tensors of 1 KB that was a minute of a 100 MB
consolidate). Instead a read that misses the cache fetches a *block*: page-aligned, as the
kernel's read-ahead does, small (``min_block`` bytes, 16 KiB) after a jump, doubled for each miss
that carries on where the previous block of that chunk file ended, up to ``max_block``, and
halved when a miss falls inside a block already read (the block was evicted before it was
used up: too many files are being read in turn for blocks that large), down to a page.
Random order costs one small read per tensor; storage order costs one read per
``max_block``; many arrays read in turn settle at about the budget divided among them, and
more of them than the budget holds blocks for at a page per read, as without a cache.

Blocks of one chunk file never overlap (a new one stops where a cached one starts), so the
block holding a byte is the cached one with the largest start at or before it. The blocks
live in their own ``BufferPool`` of ``budget_bytes``, evicted least recently used first.
"""

from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass

from ...io import BufferPool, PooledBuffer
from ...units import PAGE

MIN_BLOCK = 16 << 10  # bytes: a read after a jump; an SSD reads it about as fast as 4 KiB


@dataclass(eq=False)
class Block:
    """Bytes ``[start, end)`` of one chunk file, held in ``buf``."""

    key: tuple
    start: int
    end: int
    buf: PooledBuffer

    def view(self, offset: int, nbytes: int) -> memoryview:
        """``nbytes`` bytes from file offset ``offset`` (inside the block)."""
        at = offset - self.start
        return self.buf.memoryview(at + nbytes)[at:]


class BlockCache:
    """Disjoint cached ranges of chunk files under a byte budget (LRU).

    Args:
        budget_bytes: memory for the cached blocks (one arena, allocated once).
        max_block: largest block a miss reads (bytes, a multiple of 4096).
        min_block: block read after a jump (bytes, a multiple of 4096).
    """

    def __init__(self, budget_bytes: int, max_block: int, min_block: int = MIN_BLOCK):
        self.pool = BufferPool(budget_bytes)
        self.max_block = max(PAGE, min(max_block, self.pool.capacity) // PAGE * PAGE)
        self.min_block = max(PAGE, min(min_block, self.max_block) // PAGE * PAGE)
        self._lru: collections.OrderedDict[int, Block] = collections.OrderedDict()
        self._starts: dict[tuple, list[int]] = {}  # per chunk file: sorted block starts
        self._blocks: dict[tuple, dict[int, Block]] = {}
        self._ahead: dict[tuple, tuple[int, int, int]] = {}  # key -> (start, end, size) of its last miss

    def find(self, key: tuple, offset: int) -> Block | None:
        """The cached block of chunk file ``key`` that holds byte ``offset``, or None."""
        starts = self._starts.get(key)
        if not starts:
            return None
        i = bisect.bisect_right(starts, offset) - 1
        if i < 0:
            return None
        block = self._blocks[key][starts[i]]
        if offset >= block.end:
            return None
        self._lru.move_to_end(id(block))
        return block

    def overlaps(self, key: tuple, start: int, end: int) -> bool:
        """Whether a cached block of ``key`` holds any byte of ``[start, end)``."""
        starts = self._starts.get(key)
        if not starts:
            return False
        i = bisect.bisect_left(starts, end) - 1
        return i >= 0 and self._blocks[key][starts[i]].end > start

    def read_ahead_from(self, key: tuple, block: Block) -> None:
        """Treat ``block`` (filled by the caller) as the last miss of ``key``: a miss just
        past it reads ahead at full size."""
        self._ahead[key] = (block.start, block.end, self.max_block)

    def plan(self, key: tuple, offset: int, limit: int) -> tuple[int, int]:
        """``(start, end)`` of the block a miss at byte ``offset`` should read, inside the
        file's first ``limit`` bytes and short of the next cached block; remembers the
        miss for the read-ahead of the next."""
        last = self._ahead.get(key)
        size = self.min_block
        if last is not None:
            l_start, l_end, l_size = last
            if l_end <= offset < l_end + max(l_size, self.min_block):
                size = min(self.max_block, l_size * 2)  # carries on: read further ahead
            elif l_start <= offset < l_end:
                size = max(PAGE, l_size // 2)  # evicted before use: smaller, down to a page
        start = offset // PAGE * PAGE
        end = min(limit, start + size)
        starts = self._starts.get(key)
        if starts:
            i = bisect.bisect_right(starts, offset)
            if i < len(starts):
                end = min(end, starts[i])
        self._ahead[key] = (start, end, size)
        return start, end

    def insert(self, key: tuple, start: int, end: int) -> Block | None:
        """A buffer for bytes ``[start, end)`` of ``key``, evicting as needed; the caller
        fills it (``block.view(start, end - start)``) before the next ``find``. None when
        the bytes do not fit even in an empty cache. The range must not overlap a cached
        block of ``key``."""
        nbytes = end - start
        if nbytes <= 0 or nbytes > self.pool.capacity:
            return None
        buf = self.pool.try_acquire(nbytes)
        while buf is None and self._lru:
            self._evict(next(iter(self._lru)))
            buf = self.pool.try_acquire(nbytes)
        if buf is None:
            return None
        block = Block(key, start, end, buf)
        self._lru[id(block)] = block
        bisect.insort(self._starts.setdefault(key, []), start)
        self._blocks.setdefault(key, {})[start] = block
        return block

    def discard(self, block: Block) -> None:
        """Drop ``block`` (its read failed)."""
        self._evict(id(block))

    def _evict(self, ident: int) -> None:
        block = self._lru.pop(ident)
        starts = self._starts[block.key]
        del starts[bisect.bisect_left(starts, block.start)]
        del self._blocks[block.key][block.start]
        if not starts:
            del self._starts[block.key], self._blocks[block.key]
        block.buf.release()

    def close(self) -> None:
        """Release every block and the arena."""
        while self._lru:
            self._evict(next(iter(self._lru)))
        self.pool.close()
