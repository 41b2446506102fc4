"""Read zarr chunk files window by window: fixed buffers, read-ahead, checksums.

A *window* is a byte range of one chunk file, at most ``window_bytes`` long and a multiple
of 4096 at a 4096-aligned offset, so it moves with O_DIRECT into a page-aligned buffer of
the ``BufferPool``. ``WindowStream`` keeps ``depth`` windows in flight (``AsyncFileIO``)
while the caller works on the oldest one; memory is ``(depth + 1) * window_bytes`` whatever
the size of the input. When the manifest records a crc32c per chunk file, every window of
a chunk is read (edge padding included) and the checksum is compared when the chunk's last
window has been consumed; a mismatch is a ``ChecksumError`` naming the chunk file. A chunk
recorded as absent (``null``) must still be absent: it reads as the fill value.

Everything is bytes (memoryviews of pool buffers): no torch, no element types.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from ...io import AsyncFileIO, BufferPool, PooledBuffer
from ...layout import FlatArray
from ...layout.checksums import crc32c_extend, mismatch, missing, unexpected
from ...layout.fill_values import fill_pattern
from ...units import PAGE
from .block_cache import Block, BlockCache


class ChunkedArray:
    """A flat array of a store or checkpoint, with the crc32c of each chunk file (or None)."""

    def __init__(self, name: str, flat: FlatArray, checksums: list | None = None):
        self.name = name
        self.flat = flat
        self.checksums = checksums

    @property
    def itemsize(self) -> int:
        return self.flat.itemsize

    def chunk_of(self, element: int) -> int:
        return element // self.flat.chunk_elems

    def verified(self, chunk: int) -> bool:
        """Whether reads of ``chunk`` are checked against a recorded checksum."""
        return (self.checksums is not None and self.flat.direct
                and self.checksums[chunk] is not None)

    def recorded_absent(self, chunk: int) -> bool:
        """Whether the checkpoint recorded ``chunk`` as a chunk file that did not exist."""
        return (self.checksums is not None and self.flat.direct
                and self.checksums[chunk] is None)

    def windows(self, chunk: int, window_bytes: int) -> list["Window"]:
        """The windows that read ``chunk``: the whole file when it is checksummed, else the
        pages that hold elements (the edge chunk's padding is skipped)."""
        flat = self.flat
        ce, size = flat.chunk_elems, flat.itemsize
        first_elem = chunk * ce
        elems = min(ce, flat.numel - first_elem)
        if self.verified(chunk):
            span = flat.chunk_bytes
        else:
            span = min(flat.chunk_bytes, -(-elems * size // PAGE) * PAGE)
        out = []
        for off in range(0, span, window_bytes):
            nbytes = min(window_bytes, span - off)
            e0 = first_elem + off // size
            n = max(0, min(nbytes // size, first_elem + elems - e0))
            out.append(Window(self, chunk, off, nbytes, e0, n, off == 0, off + nbytes >= span))
        return out


@dataclass(frozen=True, eq=False)
class Window:
    """Bytes ``[offset, offset + nbytes)`` of chunk file ``chunk`` of ``array``; they hold
    array elements ``[elem_start, elem_start + elems)`` (fewer than fit in edge padding)."""

    array: ChunkedArray
    chunk: int
    offset: int
    nbytes: int
    elem_start: int
    elems: int
    first: bool
    last: bool


def chunk_present(array: ChunkedArray, chunk: int) -> bool:
    """True when the chunk file exists at its full size, False when absent (fill value).

    A short file is a TruncatedChunkError, a long one a ChunkSizeError, both naming it.
    """
    present = array.flat.chunk_state(chunk)  # size errors name the file
    path = array.flat.chunk_path(chunk)
    if not present and array.verified(chunk):
        raise missing(path)
    if present and array.recorded_absent(chunk):
        raise unexpected(path)
    return present


class WindowStream:
    """Read windows in order with ``depth`` of them in flight; yield each as a memoryview.

    Args:
        io: the file I/O (O_DIRECT where the file system allows it).
        pool: buffers; needs ``(depth + 1) * window_bytes``.
        depth: windows read ahead of the one being used.
    """

    def __init__(self, io: AsyncFileIO, pool: BufferPool, depth: int):
        self.io = io
        self.pool = pool
        self.depth = max(1, depth)
        self.bytes_read = 0

    def stream(self, windows: Iterable[Window]) -> Iterator[tuple[Window, memoryview]]:
        """Yield ``(window, bytes)``; ``bytes`` is valid until the next item is requested."""
        for w, data, release in self.stream_detached(windows):
            try:
                yield w, data
            finally:
                release()

    def stream_detached(self, windows: Iterable[Window]
                        ) -> Iterator[tuple[Window, memoryview, Callable[[], None]]]:
        """Yield ``(window, bytes, release)``: ``bytes`` stays valid until ``release()``.

        The caller may keep windows unreleased while it asks for the next (e.g. being
        reduced on worker threads): the pool needs ``depth + 1`` windows plus those it
        keeps. Releasing every window it was given is the caller's job, also after an
        error (the generator only frees the windows it has not handed out).
        """
        pending: collections.deque = collections.deque()
        held: dict[int, PooledBuffer] = {}
        it = iter(windows)
        crcs: dict[tuple[int, int], int] = {}
        present: dict[tuple[int, int], bool] = {}
        try:
            while True:
                while len(pending) < self.depth + 1:
                    w = next(it, None)
                    if w is None:
                        break
                    pending.append(self._start(w, present))
                if not pending:
                    return
                w, buf, fut = pending[0]
                if fut is not None:
                    fut.result()
                data = buf.memoryview(w.nbytes)
                self._check(w, data, crcs)
                pending.popleft()
                held[id(buf)] = buf

                def release(buf=buf):
                    if held.pop(id(buf), None) is not None:
                        buf.release()
                yield w, data, release
        finally:
            for _, buf, fut in pending:  # wait for reads still in flight before freeing
                if fut is not None:
                    try:
                        fut.result()
                    except Exception:
                        pass
                buf.release()

    def _start(self, w: Window, present: dict):
        key = (id(w.array), w.chunk)
        if w.array.flat.direct and (w.first or key not in present):
            present[key] = chunk_present(w.array, w.chunk)
        buf = self.pool.acquire(w.nbytes)
        try:
            flat = w.array.flat
            if not flat.direct:  # compressed or otherwise foreign: zarr-python decodes
                out = buf.memoryview(w.elems * flat.itemsize)
                fut = flat.read_into(w.elem_start, w.elem_start + w.elems, out)
            elif present[key]:
                fut = self.io.read(flat.chunk_path(w.chunk), w.offset, buf, w.nbytes)
                self.bytes_read += w.nbytes
            else:
                fill_pattern(buf.memoryview(w.elems * flat.itemsize), flat.fill_bytes)
                fut = None
        except BaseException:
            buf.release()
            raise
        return w, buf, fut

    def _check(self, w: Window, data: memoryview, crcs: dict) -> None:
        if not w.array.verified(w.chunk):
            return
        key = (id(w.array), w.chunk)
        crc = crc32c_extend(0 if w.first else crcs.pop(key), data)
        if not w.last:
            crcs[key] = crc
            return
        want = int(w.array.checksums[w.chunk])
        if crc != want:
            raise mismatch(w.array.flat.chunk_path(w.chunk), crc, want,
                           f"chunk {w.chunk} of array {w.array.name}")


class RangeReader:
    """Element ranges of arrays (what ``OursSource.read`` serves: load, consolidate, diff,
    export). A chunk file's bytes are served from a ``BlockCache``: a checksummed chunk is
    first read whole, window by window, and verified, its first windows kept; what is not
    cached is read in blocks that grow while reads go on in storage order, so many small
    tensors cost a few large reads, not one read each.

    Args:
        io: the file I/O.
        pool: the verification windows' buffers (``2 * window_bytes``).
        window_bytes: bytes of a verification window (a multiple of 4096).
        cache_bytes: memory for cached blocks (allocated once, apart from ``pool``).
    """

    def __init__(self, io: AsyncFileIO, pool: BufferPool, window_bytes: int, cache_bytes: int):
        self.io = io
        self.window_bytes = window_bytes
        self.stream = WindowStream(io, pool, depth=1)
        self.cache = BlockCache(cache_bytes, max_block=min(window_bytes, cache_bytes // 4))
        # keyed by (array, chunk): the key holds the array, so its identity is never reused
        self._verified: set[tuple[ChunkedArray, int]] = set()
        self._present: dict[tuple[ChunkedArray, int], bool] = {}

    def read(self, array: ChunkedArray, lo: int, hi: int, out: memoryview) -> None:
        """Elements ``[lo, hi)`` of ``array`` into the bytes ``out``."""
        flat = array.flat
        ce, size = flat.chunk_elems, flat.itemsize
        pos = lo
        while pos < hi:
            chunk = pos // ce
            end = min(hi, (chunk + 1) * ce)
            dst = out[(pos - lo) * size:(end - lo) * size]
            if array.verified(chunk):
                if (array, chunk) not in self._verified:
                    self._verify(array, chunk)
                self._copy_cached(array, chunk, pos, end, dst)
            elif flat.direct and self._is_present(array, chunk):
                self._copy_cached(array, chunk, pos, end, dst)
            else:  # absent (the fill value, no I/O) or compressed (zarr-python decodes)
                flat.read_into(pos, end, dst).result()
            pos = end

    def _is_present(self, array: ChunkedArray, chunk: int) -> bool:
        """Whether an unchecksummed chunk has its file (asked once per chunk)."""
        key = (array, chunk)
        present = self._present.get(key)
        if present is None:
            present = self._present[key] = chunk_present(array, chunk)
        return present

    def _verify(self, array: ChunkedArray, chunk: int) -> None:
        """Read chunk ``chunk`` whole and check its crc32c; keep its first windows, which
        the reads that follow (in storage order) want first."""
        key = (array, chunk)
        kept = 0
        for w, data in self.stream.stream(array.windows(chunk, self.window_bytes)):
            if w.elems and kept + w.nbytes <= self.cache.pool.capacity // 2 \
                    and not self.cache.overlaps(key, w.offset, w.offset + w.nbytes):
                block = self.cache.insert(key, w.offset, w.offset + w.nbytes)
                if block is not None:
                    block.view(w.offset, w.nbytes)[:] = data
                    self.cache.read_ahead_from(key, block)
                    kept += w.nbytes
        self._verified.add(key)

    def _copy_cached(self, array: ChunkedArray, chunk: int, lo: int, hi: int,
                     dst: memoryview) -> None:
        """Elements [lo, hi) of a present chunk into the bytes ``dst``: from cached blocks,
        a missing one read first."""
        flat, size = array.flat, array.itemsize
        key = (array, chunk)
        base = chunk * flat.chunk_elems
        pos = lo
        while pos < hi:
            offset = (pos - base) * size
            block = self.cache.find(key, offset) or self._fetch(array, chunk, offset)
            if block is None:  # the cache cannot hold a block: read straight in
                flat.read_into(pos, hi, dst[(pos - lo) * size:]).result()
                return
            n = min(hi - pos, (block.end - offset) // size)
            dst[(pos - lo) * size:(pos - lo + n) * size] = block.view(offset, n * size)
            pos += n

    def _fetch(self, array: ChunkedArray, chunk: int, offset: int) -> Block | None:
        """Read the block the cache plans for a miss at byte ``offset`` of the chunk file."""
        flat = array.flat
        key = (array, chunk)
        elems = min(flat.chunk_elems, flat.numel - chunk * flat.chunk_elems)
        limit = min(flat.chunk_bytes, -(-elems * flat.itemsize // PAGE) * PAGE)
        start, end = self.cache.plan(key, offset, limit)
        block = self.cache.insert(key, start, end)
        if block is None:
            return None
        try:
            self.io.read(flat.chunk_path(chunk), start, block.buf, end - start).result()
        except BaseException:
            self.cache.discard(block)
            raise
        return block

    def close(self) -> None:
        self.cache.close()
