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
    export): reads go straight into the caller's bytes, except that a checksummed chunk is
    first read whole, window by window, and verified; its windows stay in a small cache
    that serves the reads that follow."""

    def __init__(self, io: AsyncFileIO, pool: BufferPool, window_bytes: int, cache_windows: int):
        self.io = io
        self.pool = pool
        self.window_bytes = window_bytes
        self.stream = WindowStream(io, pool, depth=1)
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cache_windows = max(1, cache_windows)
        self._verified: set[tuple[int, int]] = set()

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
                if (id(array), chunk) not in self._verified:
                    self._verify(array, chunk)
                self._copy_verified(array, chunk, pos, end, dst)
            else:
                if array.recorded_absent(chunk):
                    chunk_present(array, chunk)  # raises if a file appeared since the save
                flat.read_into(pos, end, dst).result()
            pos = end

    def _verify(self, array: ChunkedArray, chunk: int) -> None:
        for w, data in self.stream.stream(array.windows(chunk, self.window_bytes)):
            self._remember(w, data)
        self._verified.add((id(array), chunk))

    def _remember(self, w: Window, data: memoryview) -> None:
        if w.elems == 0:
            return
        buf = self.pool.try_acquire(w.nbytes)
        if buf is None:
            while self._cache and buf is None:
                self._cache.popitem(last=False)[1].release()
                buf = self.pool.try_acquire(w.nbytes)
            if buf is None:
                return
        buf.memoryview(w.nbytes)[:] = data
        self._cache[(id(w.array), w.chunk, w.offset)] = buf
        self._cache.move_to_end((id(w.array), w.chunk, w.offset))
        while len(self._cache) > self._cache_windows:
            self._cache.popitem(last=False)[1].release()

    def _copy_verified(self, array: ChunkedArray, chunk: int, lo: int, hi: int,
                       dst: memoryview) -> None:
        """Elements [lo, hi) of a verified chunk into the bytes ``dst``: from cached
        windows, or read again."""
        flat, size = array.flat, array.itemsize
        base = chunk * flat.chunk_elems
        pos = lo
        while pos < hi:
            off = (pos - base) * size // self.window_bytes * self.window_bytes
            w_end = min(hi, base + (off + self.window_bytes) // size)
            buf: PooledBuffer | None = self._cache.get((id(array), chunk, off))
            piece = dst[(pos - lo) * size:(w_end - lo) * size]
            if buf is not None:
                self._cache.move_to_end((id(array), chunk, off))
                start = (pos - base) * size - off
                piece[:] = buf.memoryview(start + len(piece))[start:]
            else:
                flat.read_into(pos, w_end, piece).result()
            pos = w_end

    def close(self) -> None:
        while self._cache:
            self._cache.popitem()[1].release()
