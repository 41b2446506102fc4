"""Read many small byte ranges of a few files as few large ``preadv`` calls.

A window of output tensors needs, from each rank file, a run of ranges that are mostly
back to back (ZeRO keeps parameters in the same order on every rank). Ranges are sorted
per file and merged into one ``preadv`` whose iovecs scatter the bytes straight to their
destinations; a small hole between two ranges (ZeRO-3 tail padding, the zip header between
two storage records) is read into a scratch sink instead of costing another call, but
only when the hole holds no forbidden record: bytes of storages the caller did not ask for
(Adam moments, when only master weights are read) are never read. Runs are cut into pieces of at most
``max_piece`` bytes, read in parallel: a cold file is read far faster with several
requests in flight (each gets its own readahead) than by one long ``preadv`` per file
(cold ZeRO-3 files, 2 ranks, 1 GB: 1.4-1.8 GB/s with 8 threads x 8 MiB pieces against
0.65-0.9 GB/s with one call per file in flight).

Each run's bytes are dropped from the page cache once read (``POSIX_FADV_DONTNEED``): every
reader of a DeepSpeed checkpoint (import, consolidate, inspect) reads a byte once, and a
checkpoint larger than the host's RAM otherwise fills the cache and makes the kernel
reclaim it on the same cores, in the way of the reads (import of 32 GB on a 23 GiB
machine: 39.9 s of system time against 1.5 s for 3.3 GB, docs/benchmarks.md).
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import errno
import os
import threading
from dataclasses import dataclass

from ...io import FileIOError, TruncatedFileError
from ...units import MiB

_IOV_MAX = max(16, min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024))


@dataclass(slots=True)
class Want:
    """``len(dest)`` bytes at byte ``offset`` of file number ``file`` go to ``dest``."""

    file: int
    offset: int
    dest: memoryview


@dataclass(frozen=True, slots=True)
class Segment:
    """Elements ``[start, start + count)`` of a tensor lie at byte ``offset`` of file ``file``."""

    start: int
    count: int
    file: int
    offset: int


class ScatterReader:
    """Coalescing reader over a fixed list of files.

    Args:
        paths: the files, numbered by position.
        forbidden: per file, sorted non-overlapping ``(start, end)`` byte spans that must
            never be read (records of storages nobody asked for); ``read`` may give others.
        max_gap: largest hole (bytes) bridged through the sink inside one ``preadv``.
        threads: parallel pieces in flight.
        max_piece: largest piece (bytes) one ``preadv`` call sequence reads.
        max_open: idle file descriptors kept open.
        drop_behind: drop each run's bytes from the page cache once read.
    """

    def __init__(self, paths: list[str], forbidden: list[list[tuple[int, int]]] | None = None,
                 max_gap: int = 64 * 1024, threads: int = 8, max_open: int = 128,
                 max_piece: int = 8 * MiB, drop_behind: bool = True):
        self.paths = list(paths)
        self.drop_behind = drop_behind
        self._forbidden = forbidden if forbidden is not None else [[] for _ in self.paths]
        self.max_gap = max_gap
        self.max_piece = max(1, max_piece)
        self._sink = bytearray(max_gap)  # contents never used; concurrent writes are harmless
        self._fds: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._users: dict[int, int] = {}
        self.max_open = max_open
        self._fd_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads),
                                                           thread_name_prefix="oe-ds-read")
        self.bytes_read = 0
        self.calls = 0
        self.trace: list[tuple[int, int, int]] | None = None  # (file, offset, nbytes) when enabled
        self._stats_lock = threading.Lock()

    def read(self, wants: list[Want], forbidden: list[list[tuple[int, int]]] | None = None) -> None:
        """Fill every ``dest``; raises FileIOError / TruncatedFileError naming the file.
        ``forbidden`` replaces the reader's spans for this call."""
        runs = self._plan(wants, self._forbidden if forbidden is None else forbidden)
        if len(runs) == 1:
            self._run(*runs[0])
            return
        futures = [self._pool.submit(self._run, *run) for run in runs]
        # all finish before any error is raised: the caller may free the destination buffers
        concurrent.futures.wait(futures)
        for f in futures:
            f.result()

    def _plan(self, wants: list[Want], forbidden) -> list[tuple[int, int, list[memoryview]]]:
        """Merge ranges into runs, cut into pieces ``(file, offset, iovecs)`` of at most
        ``max_piece`` bytes."""
        return [piece for run in self._runs(wants, forbidden) for piece in self._split(*run)]

    def _split(self, file: int, offset: int, iov: list[memoryview]) -> list[tuple[int, int, list[memoryview]]]:
        pieces: list[tuple[int, int, list[memoryview]]] = []
        cur: list[memoryview] = []
        start, size = offset, 0
        for v in iov:
            while len(v):
                take = min(len(v), self.max_piece - size)
                cur.append(v[:take])
                v = v[take:]
                size += take
                if size == self.max_piece:
                    pieces.append((file, start, cur))
                    start, cur, size = start + size, [], 0
        if cur:
            pieces.append((file, start, cur))
        return pieces

    def _runs(self, wants: list[Want], forbidden) -> list[tuple[int, int, list[memoryview]]]:
        """Merge ranges into runs ``(file, offset, iovecs)``."""
        runs: list[tuple[int, int, list[memoryview]]] = []
        ordered = sorted((w for w in wants if len(w.dest)), key=lambda w: (w.file, w.offset))
        cur_file, cur_start, cur_end, cur_iov = -1, 0, 0, None
        for w in ordered:
            gap = w.offset - cur_end
            if (w.file == cur_file and 0 <= gap <= self.max_gap and len(cur_iov) < _IOV_MAX - 1
                    and _gap_allowed(forbidden[w.file], cur_end, w.offset)):
                if gap:
                    cur_iov.append(memoryview(self._sink)[:gap])
                cur_iov.append(w.dest)
                cur_end = w.offset + len(w.dest)
                continue
            if cur_iov is not None:
                runs.append((cur_file, cur_start, cur_iov))
            cur_file, cur_start, cur_end, cur_iov = w.file, w.offset, w.offset + len(w.dest), [w.dest]
        if cur_iov is not None:
            runs.append((cur_file, cur_start, cur_iov))
        return runs

    def _acquire_fd(self, file: int) -> int:
        """A descriptor of ``file``, cached; at most ``max_open`` idle ones stay open (a
        ZeRO-3 run of 1024 ranks has 2048 files, more than a default ulimit)."""
        with self._fd_lock:
            fd = self._fds.get(file)
            if fd is None:
                path = self.paths[file]
                try:
                    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except OSError as e:
                    raise FileIOError(e.errno, "open", path) from e
                self._fds[file] = fd
            self._fds.move_to_end(file)
            self._users[file] = self._users.get(file, 0) + 1
            return fd

    def _release_fd(self, file: int) -> None:
        with self._fd_lock:
            self._users[file] -= 1
            if len(self._fds) <= self.max_open:
                return
            for f in list(self._fds):
                if len(self._fds) <= self.max_open:
                    break
                if not self._users.get(f):
                    os.close(self._fds.pop(f))

    def _run(self, file: int, offset: int, iov: list[memoryview]) -> None:
        fd = self._acquire_fd(file)
        try:
            self._read_run(file, fd, offset, iov)
        finally:
            self._release_fd(file)

    def _read_run(self, file: int, fd: int, offset: int, iov: list[memoryview]) -> None:
        path = self.paths[file]
        total = sum(len(v) for v in iov)
        if self.trace is not None:
            with self._stats_lock:
                self.trace.append((file, offset, total))
        iov = list(iov)
        pos, i, calls = offset, 0, 0
        while i < len(iov):
            try:
                n = os.preadv(fd, iov[i:i + _IOV_MAX], pos)
            except OSError as e:
                raise FileIOError(e.errno, "read", path, pos, offset + total - pos) from e
            calls += 1
            if n == 0:
                size = os.fstat(fd).st_size
                raise TruncatedFileError(errno.ENODATA, "read", path, pos, offset + total - pos,
                                         detail=f"file ends at byte {size} (truncated file?)")
            pos += n
            while n:  # drop what was filled; a partly filled iovec keeps its tail
                if n >= len(iov[i]):
                    n -= len(iov[i])
                    i += 1
                else:
                    iov[i] = iov[i][n:]
                    n = 0
        if self.drop_behind and hasattr(os, "posix_fadvise"):
            try:  # advice only: a file system without it reads the same
                os.posix_fadvise(fd, offset, total, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
        with self._stats_lock:
            self.bytes_read += total
            self.calls += calls

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._fd_lock:
            for fd in self._fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds.clear()


def _gap_allowed(spans: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether bytes ``[start, end)`` of a file touch none of its forbidden ``spans``
    (sorted, disjoint)."""
    if start == end:
        return True
    i = bisect.bisect_left(spans, (end,))  # spans starting before the hole's end
    if i == 0:
        return True
    return spans[i - 1][1] <= start  # that span ends before the hole
