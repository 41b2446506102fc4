"""Asynchronous file I/O: a pool of threads issuing ``os.preadv`` / ``os.pwritev``.

Both calls release the GIL, so N threads keep N requests in flight at the device. A request
is cut into ``block_size`` pieces; pieces run on ``threads`` worker threads with at most
``queue_depth`` in flight, taken in turn from the oldest ``streams`` requests of their
direction (one piece from each: several regions of the disk busy at once; with 1, requests
are served in order). A sync waits for its turn: no piece queued after it starts before it. Each request returns one ``IOFuture``: ``.result()`` from a
thread, ``await`` from asyncio. Every piece loops until all of its bytes moved (Linux moves
at most 2,147,479,552 bytes per call); a read that meets end of file first is an error that
names the file.

Reads and writes each have their own settings (io/settings.py): mode, queue depth and block
size. In "direct" mode O_DIRECT is used where the file system accepts it and the piece is
aligned (address, offset and length multiples of 4096); a request that starts on a page has
its last piece cut at its last page boundary, so only a tail shorter than a page is buffered.
The first refusal (EINVAL) in a directory switches that directory to buffered I/O, logged
once. "buffered" mode goes through the page cache on purpose (where the device reads faster
that way): a read piece is announced first (POSIX_FADV_WILLNEED: the kernel reads its range
ahead in large requests; the descriptor is marked RANDOM so nothing beyond what is announced
is read) and dropped after (DONTNEED); a written piece is written
out (sync_file_range) and dropped, so the page cache never grows with the state. Every
buffered piece, including the sub-page tails of direct mode, follows these rules. Settings
may change while running (``set_settings``, used by the adaptive controller): pieces already
queued keep their block size and take the mode in force when they start; bytes are the same
either way (an O_DIRECT read writes back dirty cached pages of its range first, an O_DIRECT
write invalidates them, and buffered writes are written out before they complete anyway).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import threading
import time

from ..units import MiB
from .align import ALIGN, address_of, as_byte_view, is_aligned
from . import syscalls
from .errors import FileIOError, TruncatedFileError
from .fd_cache import DEFAULT_MAX_FILES, DescriptorCache, OpenFile, descriptor_limit
from .requests import IOFuture, IOStats, Request
from .settings import DIRECTIONS, DirectionSettings
from ..errors import InputError, UsageError
from ..interrupts import InterruptSafeCondition

log = logging.getLogger(__name__)

# Linux moves at most this many bytes in one read/write call (MAX_RW_COUNT).
_LINUX_MAX_RW = 0x7FFFF000


class AsyncFileIO:
    """Thread-pool file I/O on cached file descriptors.

    Args:
        threads: worker threads issuing system calls.
        queue_depth: most pieces in flight at once per direction (the device sees at most
            ``threads``), unless ``read``/``write`` say otherwise.
        block_size: bytes per piece; a multiple of 4096 (likewise).
        direct: True forces O_DIRECT (errors where refused), False never uses it,
            None (default) follows each direction's mode.
        max_open_files: files whose descriptors are kept open at most; fewer where the
            process's descriptor limit asks for it (io/fd_cache.py); the least recently used
            idle one is closed first.
        read, write: the settings of each direction (mode, queue depth, block size); default:
            "direct" mode (buffered with ``direct=False``) with ``queue_depth`` and ``block_size``.
    """

    def __init__(self, threads: int = 8, queue_depth: int = 8, block_size: int = 8 * MiB,
                 direct: bool | None = None, max_open_files: int = DEFAULT_MAX_FILES,
                 read: DirectionSettings | None = None, write: DirectionSettings | None = None):
        if threads < 1 or queue_depth < 1:
            raise InputError("threads and queue_depth must be >= 1")
        if block_size <= 0 or block_size % ALIGN:
            raise InputError(f"block_size must be a positive multiple of {ALIGN}, got {block_size}")
        self.threads = threads
        self.direct = direct
        self.max_open_files = max_open_files
        base = DirectionSettings("buffered" if direct is False else "direct", queue_depth,
                                 block_size, "config")
        self._settings = {"read": read or base, "write": write or base}
        if direct is not None:  # an explicit direct= wins over the modes
            mode = "direct" if direct else "buffered"
            self._settings = {op: st.with_(mode=mode) for op, st in self._settings.items()}
        self.stats = IOStats()
        self._stats_lock = threading.Lock()
        self._files = DescriptorCache(max_open_files)
        self._direct_ok: dict[str, bool] = {}  # per directory
        # per direction: requests waiting, the ones being served (at most `streams`, one
        # piece from each in turn), the next one's index, and the pieces in flight (at most
        # the queue depth)
        self._queues = {op: collections.deque() for op in DIRECTIONS}
        self._serving = {op: [] for op in DIRECTIONS}
        self._cursor = {op: 0 for op in DIRECTIONS}
        self._inflight = {op: 0 for op in DIRECTIONS}
        self._turn = 0
        self._queue_cv = InterruptSafeCondition()  # a submit is never left half queued
        self._outstanding = {op: 0 for op in DIRECTIONS}  # requests, for the busy seconds
        self._busy_since = {op: 0.0 for op in DIRECTIONS}
        self._closed = False
        self._workers = [threading.Thread(target=self._work, name=f"oe-io-{i}", daemon=True)
                         for i in range(threads)]
        for w in self._workers:
            w.start()

    @property
    def queue_depth(self) -> int:
        """Most pieces in flight in either direction."""
        return max(st.queue_depth for st in self._settings.values())

    @property
    def block_size(self) -> int:
        """Largest piece of either direction (bytes)."""
        return max(self._piece_limit(op) for op in DIRECTIONS)

    def settings(self, op: str) -> DirectionSettings:
        """The settings in force for ``op`` ("read" or "write")."""
        return self._settings[op]

    def set_settings(self, op: str, settings: DirectionSettings) -> None:
        """Change ``op``'s mode, queue depth or block size from now on (requests already
        queued keep their pieces; each piece takes the mode in force when it starts)."""
        if op not in DIRECTIONS:
            raise InputError(f"op must be one of {DIRECTIONS}, got {op!r}")
        if self.direct is not None:
            settings = settings.with_(mode="direct" if self.direct else "buffered")
        with self._queue_cv:
            self._settings = {**self._settings, op: settings}
            self._queue_cv.notify_all()

    def _piece_limit(self, op: str) -> int:
        return min(self._settings[op].block_bytes, _LINUX_MAX_RW // ALIGN * ALIGN)

    # -- public API ---------------------------------------------------------------------
    def read(self, path: str | os.PathLike, offset: int, buffer, length: int | None = None) -> IOFuture:
        """Read ``length`` bytes (default: the buffer's size) at byte ``offset`` of ``path``
        into ``buffer`` (a CPU tensor, numpy array, bytearray, mmap, memoryview or
        PooledBuffer). The future's result is the byte count."""
        return self._submit("read", path, offset, buffer, length, sync=False)

    def write(self, path: str | os.PathLike, offset: int, buffer, length: int | None = None,
              sync: bool = False) -> IOFuture:
        """Write ``length`` bytes (default: all) of ``buffer`` at byte ``offset`` of ``path``,
        creating the file if needed; with ``sync`` the future completes after fdatasync."""
        return self._submit("write", path, offset, buffer, length, sync=sync)

    def sync(self, path: str | os.PathLike) -> IOFuture:
        """fdatasync ``path`` on a worker thread."""
        path = os.fspath(path)
        fut = IOFuture()
        fut.set_running_or_notify_cancel()
        self._enqueue("write", ("sync", path, fut), 1)
        return fut

    def preallocate(self, path: str | os.PathLike, nbytes: int) -> None:
        """Create ``path`` if needed and reserve ``nbytes`` bytes for it (posix_fallocate).

        Unwritten extents read as zeros. A full disk raises FileIOError(ENOSPC) naming the
        file; where the file system has no fallocate, the file is extended with ftruncate.
        """
        path = os.fspath(path)
        entry = self._acquire_file(path, writable=True)
        try:
            fd = self._fd(entry, direct=False)
            try:
                syscalls.fallocate(fd, 0, nbytes, path)
            except OSError as e:
                if nbytes == 0:
                    return  # nothing to reserve (posix_fallocate refuses a zero length)
                if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    try:
                        if os.fstat(fd).st_size < nbytes:
                            syscalls.ftruncate(fd, nbytes, path)
                    except OSError as e2:
                        raise FileIOError(e2.errno, "preallocate", path, 0, nbytes) from e2
                else:
                    raise FileIOError(e.errno, "preallocate", path, 0, nbytes) from e
        finally:
            self._release_file(entry)

    def forget(self, path: str | os.PathLike) -> None:
        """Close cached descriptors of ``path`` (before it is renamed or removed)."""
        self._files.forget(os.fspath(path))

    def uses_direct(self, path: str | os.PathLike) -> bool | None:
        """Whether O_DIRECT is used in ``path``'s directory (None: not yet probed); False
        where both directions are in buffered mode."""
        if self.direct is False or all(st.mode == "buffered" for st in self._settings.values()):
            return False
        return self._direct_ok.get(os.path.dirname(os.path.abspath(os.fspath(path))))

    def reset_stats(self) -> IOStats:
        """Return the counters so far and start new ones."""
        old, self.stats = self.stats, IOStats()
        return old

    def close(self) -> None:
        """Finish queued work, stop the threads and close every descriptor."""
        if self._closed:
            return
        with self._queue_cv:
            self._closed = True
            self._queue_cv.notify_all()
        for w in self._workers:
            w.join()
        self._files.close()

    def __enter__(self) -> "AsyncFileIO":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def open_files(self) -> int:
        return len(self._files)

    # -- request splitting ---------------------------------------------------------------
    def _submit(self, op: str, path, offset: int, buffer, length: int | None, sync: bool) -> IOFuture:
        if self._closed:
            raise UsageError("AsyncFileIO is closed")
        path = os.fspath(path)
        if offset < 0:
            raise InputError(f"negative offset {offset} for {path}")
        keepalive = buffer
        if hasattr(buffer, "memoryview") and hasattr(buffer, "pool"):  # PooledBuffer
            view = buffer.memoryview()
        else:
            view = as_byte_view(buffer)
        if length is not None:
            if length > len(view):
                raise InputError(f"{op} of {length} bytes into a buffer of {len(view)} bytes ({path})")
            view = view[:length]
        if op == "read" and view.readonly:
            raise InputError(f"read from {path} into a read-only buffer")
        fut = IOFuture()
        fut.set_running_or_notify_cancel()
        nbytes = len(view)
        req = Request(op, path, offset, view, fut, sync, keepalive=keepalive)
        if nbytes == 0 and not sync:
            fut.set_result(0)
            return fut
        pieces = self._pieces(op, path, offset, view)
        req.pending = len(pieces)
        with self._stats_lock:
            if op == "read":
                self.stats.reads += 1
            else:
                self.stats.writes += 1
            self._outstanding[op] += 1
            if self._outstanding[op] == 1:
                self._busy_since[op] = time.monotonic()
        try:
            self._enqueue(op, ("pieces", req, collections.deque(pieces)), len(pieces))
        except BaseException:  # Ctrl-C before it was queued: not outstanding after all
            self._request_done(op)
            raise
        return fut

    def _request_done(self, op: str) -> None:
        with self._stats_lock:
            self._outstanding[op] -= 1
            if self._outstanding[op] == 0:
                busy = time.monotonic() - self._busy_since[op]
                if op == "read":
                    self.stats.read_busy_s += busy
                else:
                    self.stats.write_busy_s += busy

    def _pieces(self, op: str, path: str, offset: int, view: memoryview) -> list[tuple[int, int]]:
        """``(start, length)`` of each piece of a request: ``block_size`` bytes each, and,
        where the request starts on a page (offset and address) and O_DIRECT may be used,
        a last piece that does not end on a page is cut at its last page boundary, so only
        the tail (< 4096 bytes) goes through the page cache, not up to a whole block."""
        nbytes = len(view)
        block = self._piece_limit(op)
        pieces = [(start, min(block, nbytes - start))
                  for start in range(0, nbytes, block)] or [(0, 0)]
        start, length = pieces[-1]
        whole = length // ALIGN * ALIGN
        if (0 < whole < length and is_aligned(offset) and is_aligned(address_of(view))
                and self._direct_allowed(path, op)):
            pieces[-1:] = [(start, whole), (start + whole, length - whole)]
        return pieces

    def _enqueue(self, op: str, entry, nitems: int) -> None:
        """Queue a request's pieces (``("pieces", req, deque of (start, length))``) or a
        sync (``("sync", path, future)``); wake a worker per item, up to all of them."""
        with self._queue_cv:
            self._queues[op].append(entry)
            self._queue_cv.notify(min(nitems, self.threads))

    def _take(self):
        """The next item of a direction with work and room under its queue depth, the
        directions taken in turn; (op, item) or None. Called with ``_queue_cv`` held."""
        for k in range(len(DIRECTIONS)):
            op = DIRECTIONS[(self._turn + k) % len(DIRECTIONS)]
            if ((self._serving[op] or self._queues[op])
                    and self._inflight[op] < self._settings[op].queue_depth):
                self._turn = (self._turn + k + 1) % len(DIRECTIONS)
                self._inflight[op] += 1
                return op, self._next_item(op)
        return None

    def _next_item(self, op: str):
        """One piece from each request being served in turn (``("piece", req, start,
        length)``), or a sync (``("sync", path, future)``). Requests join the served ones in
        order, up to ``streams`` of them; a sync joins only when none is being served and
        none joins while it is, so it starts after every piece queued before it and before
        any queued after it. Called with ``_queue_cv`` held."""
        serving, waiting = self._serving[op], self._queues[op]
        streams = self._settings[op].streams
        while waiting and len(serving) < streams:
            if serving and (serving[-1][0] == "sync" or waiting[0][0] == "sync"):
                break
            serving.append(waiting.popleft())
        i = self._cursor[op] % len(serving)
        entry = serving[i]
        if entry[0] == "sync":
            del serving[i]
            self._cursor[op] = i
            return entry
        _, req, pieces = entry
        start, length = pieces.popleft()
        if pieces:
            self._cursor[op] = i + 1
        else:  # the request's last piece: the next request takes its place in the turn
            del serving[i]
            self._cursor[op] = i
        return "piece", req, start, length

    def _work(self) -> None:
        while True:
            with self._queue_cv:
                while True:
                    taken = self._take()
                    if taken is not None:
                        break
                    if self._closed and not any(self._queues.values()) \
                            and not any(self._serving.values()):
                        return
                    self._queue_cv.wait()
            op, item = taken
            try:
                if item[0] == "sync":
                    self._do_sync(item[1], item[2])
                else:
                    self._do_piece(*item[1:])
            finally:
                item = taken = None  # drop the buffer view now: an idle worker must not pin the pool
                with self._queue_cv:
                    self._inflight[op] -= 1
                    # one slot is free: one waiting worker can use it (waking every worker
                    # per piece cost ~100 futex calls per small read); all must see a close
                    if self._closed:
                        self._queue_cv.notify_all()
                    elif self._serving[op] or self._queues[op]:
                        self._queue_cv.notify()

    def _do_sync(self, path: str, fut: IOFuture) -> None:
        entry = None
        try:
            entry = self._acquire_file(path, writable=False)
            fd = self._fd(entry, direct=False)
            syscalls.fdatasync(fd, path)
            with self._stats_lock:
                self.stats.syncs += 1
            fut.set_result(0)
        except FileIOError as e:
            fut.set_exception(e)
        except OSError as e:
            fut.set_exception(FileIOError(e.errno, "fdatasync", path))
        finally:
            if entry is not None:
                self._release_file(entry)

    def _do_piece(self, req: Request, start: int, length: int) -> None:
        try:
            if req.error is None and length:
                self._transfer(req, start, length)
        except BaseException as e:  # recorded on the request; the future carries it
            with req.lock:
                if req.error is None:
                    req.error = e
        with req.lock:
            req.pending -= 1
            last = req.pending == 0
        if not last:
            return
        if req.error is None and req.sync:
            try:
                self._sync_path(req)
            except BaseException as e:
                req.error = e
        req.keepalive = None
        self._request_done(req.op)
        if req.error is not None:
            req.future.set_exception(req.error)
        else:
            req.future.set_result(len(req.view))

    def _sync_path(self, req: Request) -> None:
        entry = self._acquire_file(req.path, writable=True)
        try:
            syscalls.fdatasync(self._fd(entry, direct=False), req.path)
            with self._stats_lock:
                self.stats.syncs += 1
        except OSError as e:
            raise FileIOError(e.errno, "fdatasync", req.path) from e
        finally:
            self._release_file(entry)

    def _transfer(self, req: Request, start: int, length: int) -> None:
        piece = req.view[start:start + length]
        offset = req.offset + start
        writable = req.op == "write"
        entry = self._acquire_file(req.path, writable=writable)
        try:
            aligned = (is_aligned(offset) and is_aligned(length)
                       and is_aligned(address_of(piece)))
            if aligned and self._direct_allowed(req.path, req.op):
                try:
                    self._loop(req, entry, piece, offset, direct=True)
                    with self._stats_lock:
                        self.stats.direct_pieces += 1
                    return
                except _DirectRefused:
                    self._mark_no_direct(req.path, "I/O")
            self._buffered(req, entry, piece, offset)
            with self._stats_lock:
                self.stats.buffered_pieces += 1
        finally:
            self._release_file(entry)

    def _buffered(self, req: Request, entry: OpenFile, piece: memoryview, offset: int) -> None:
        """One piece through the page cache without leaving it there: a read is announced
        (WILLNEED: the kernel reads the whole range ahead at once) and dropped after; a
        write is written out (sync_file_range) and dropped, so dirty pages never pile up."""
        fd = self._fd(entry, direct=False)
        length = len(piece)
        if req.op == "read":
            syscalls.fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
            self._loop(req, entry, piece, offset, direct=False)
        else:
            self._loop(req, entry, piece, offset, direct=False)
            try:
                syscalls.write_out(fd, offset, length, req.path)
            except OSError as e:
                raise FileIOError(e.errno, "write", req.path, offset, length) from e
        syscalls.fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)

    def _loop(self, req: Request, entry: OpenFile, piece: memoryview, offset: int, direct: bool) -> None:
        """Move every byte of ``piece``; short transfers continue where they stopped."""
        fd = self._fd(entry, direct)
        done, total = 0, len(piece)
        while done < total:
            chunk = piece[done:done + _LINUX_MAX_RW]
            try:
                if req.op == "read":
                    n = syscalls.preadv(fd, [chunk], offset + done, req.path)
                else:
                    n = syscalls.pwritev(fd, [chunk], offset + done, req.path)
            except OSError as e:
                if direct and done == 0 and e.errno == errno.EINVAL:
                    raise _DirectRefused() from e
                raise FileIOError(e.errno, req.op, req.path, offset + done, total - done) from e
            if n == 0:
                if req.op == "read":
                    size = os.fstat(fd).st_size
                    raise TruncatedFileError(
                        errno.ENODATA, "read", req.path, offset + done, total - done,
                        detail=f"file ends at byte {size}, before the requested range "
                               f"[{req.offset}, {req.offset + len(req.view)}) (truncated file?)")
                raise FileIOError(errno.EIO, "write", req.path, offset + done, total - done,
                                  detail="write moved no bytes")
            done += n
        with self._stats_lock:
            if req.op == "read":
                self.stats.bytes_read += total
            else:
                self.stats.bytes_written += total

    # -- descriptors ---------------------------------------------------------------------
    def _direct_allowed(self, path: str, op: str) -> bool:
        if self.direct is False or self._settings[op].mode != "direct":
            return False
        return self._direct_ok.get(os.path.dirname(os.path.abspath(path)), True)

    def _mark_no_direct(self, path: str, where: str) -> None:
        d = os.path.dirname(os.path.abspath(path))
        if self.direct is True:
            raise FileIOError(errno.EINVAL, "open", path, detail="O_DIRECT was required but refused")
        if self._direct_ok.get(d, True):
            log.warning("O_DIRECT refused in %s (at %s); using buffered I/O with "
                        "posix_fadvise there", d, where)
        self._direct_ok[d] = False

    def _acquire_file(self, path: str, writable: bool) -> OpenFile:
        return self._files.acquire(path, writable)

    def _release_file(self, entry: OpenFile) -> None:
        self._files.release(entry)

    def _fd(self, entry: OpenFile, direct: bool) -> int:
        try:
            fd = self._files.descriptor(entry, "direct_fd" if direct else "buffered_fd",
                                        lambda: self._open(entry, direct))
        except FileIOError:
            raise
        except OSError as e:  # out of descriptors even with every idle one closed
            raise FileIOError(e.errno, "open", entry.path, detail=(
                f"out of file descriptors (RLIMIT_NOFILE {descriptor_limit()}, with every idle "
                f"cached one closed): raise `ulimit -n`")) from e
        if direct:
            self._direct_ok.setdefault(os.path.dirname(os.path.abspath(entry.path)), True)
        return fd

    def _open(self, entry: OpenFile, direct: bool) -> int:
        """A new descriptor of ``entry``'s file (O_DIRECT if ``direct``); EMFILE and ENFILE
        come as the OSError (the cache sheds idle descriptors and tries again)."""
        flags = (os.O_RDWR | os.O_CREAT) if entry.writable else os.O_RDONLY
        flags |= getattr(os, "O_CLOEXEC", 0)
        if direct:
            flags |= os.O_DIRECT
        try:
            fd = syscalls.open_fd(entry.path, flags, 0o644)
        except OSError as e:
            if direct and e.errno == errno.EINVAL:
                raise _DirectRefused() from e
            if e.errno in (errno.EMFILE, errno.ENFILE):
                raise
            raise FileIOError(e.errno, "open", entry.path) from e
        if not direct:
            # Every buffered read piece announces its own range (WILLNEED), so the kernel's
            # heuristic readahead adds nothing but pages outside the piece: on a miss (the
            # kernel may drop a WILLNEED under memory pressure) it reads on up to
            # read_ahead_kb (8 MiB on some virtual disks, doubled by SEQUENTIAL) into ranges
            # other pieces have already dropped, and those pages then stay cached. RANDOM
            # turns the heuristic off for this descriptor; WILLNEED is unaffected.
            syscalls.fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return fd


class _DirectRefused(Exception):
    """O_DIRECT was refused (EINVAL) by the file system; retry buffered."""
