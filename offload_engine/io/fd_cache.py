"""The descriptors an ``AsyncFileIO`` keeps open, sized from the process's descriptor limit.

Each file I/O object caches the descriptors of the files it reads and writes (one for
O_DIRECT, one for buffered I/O per file), least recently used first out. How many it keeps
follows ``RLIMIT_NOFILE``: half of the soft limit is left to the rest of the process
(libraries, sockets, the user's own files), the other half is shared by the caches alive
in the process, two descriptors per file. A fixed 256 files per cache ran a store of 300
arrays out of descriptors (EMFILE) at ``ulimit -n 1024``, the usual default.

A limit can still be reached (another cache grew first, the user opened files): an open
that fails with EMFILE or ENFILE closes every idle cached descriptor, in every cache of
the process, and is tried once more before the error reaches the caller.
"""

from __future__ import annotations

import collections
import errno
import os
import resource
import threading
import weakref
from typing import Callable

DEFAULT_MAX_FILES = 256  # files per cache at most, whatever the limit
_FDS_PER_FILE = 2        # an O_DIRECT and a buffered descriptor
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)

_live: "weakref.WeakSet[DescriptorCache]" = weakref.WeakSet()
_live_lock = threading.Lock()


class OpenFile:
    """One cached file: its descriptors (None until first used) and current users."""

    __slots__ = ("path", "writable", "direct_fd", "buffered_fd", "users")

    def __init__(self, path: str, writable: bool):
        self.path = path
        self.writable = writable
        self.direct_fd: int | None = None
        self.buffered_fd: int | None = None
        self.users = 0


def descriptor_limit() -> int:
    """The soft RLIMIT_NOFILE of this process (descriptors); a large number if unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def files_per_cache(max_files: int, caches: int) -> int:
    """Files one of ``caches`` live caches may keep open: its share of half the descriptor
    limit, two descriptors a file, at most ``max_files``, at least 1."""
    share = descriptor_limit() // 2 // max(caches, 1) // _FDS_PER_FILE
    return max(1, min(max_files, share))


class DescriptorCache:
    """Open files by path, least recently used first, at most ``limit`` of them kept open
    while idle. ``max_files`` bounds the limit whatever the descriptor limit allows."""

    def __init__(self, max_files: int = DEFAULT_MAX_FILES):
        self.max_files = max_files
        self.lock = threading.Lock()
        self.files: collections.OrderedDict[str, OpenFile] = collections.OrderedDict()
        with _live_lock:
            _live.add(self)

    @property
    def limit(self) -> int:
        """Files kept open now (the share of the limit, which changes as caches come and go)."""
        with _live_lock:
            caches = len(_live)
        return files_per_cache(self.max_files, caches)

    def __len__(self) -> int:
        return len(self.files)

    def acquire(self, path: str, writable: bool) -> OpenFile:
        """The entry of ``path`` with one more user (opened for writing if ``writable``)."""
        with self.lock:
            entry = self.files.get(path)
            if entry is not None and writable and not entry.writable:
                del self.files[path]
                if entry.users == 0:
                    close_entry(entry)
                # else: later users get a new read-write entry; this one closes when released
                entry = None
            if entry is None:
                entry = OpenFile(path, writable)
                self.files[path] = entry
                self._evict_idle(self.limit)
            self.files.move_to_end(path)
            entry.users += 1
            return entry

    def release(self, entry: OpenFile) -> None:
        with self.lock:
            entry.users -= 1
            if entry.users == 0 and self.files.get(entry.path) is not entry:
                close_entry(entry)  # replaced while in use

    def descriptor(self, entry: OpenFile, attr: str, opener: Callable[[], int]) -> int:
        """``entry``'s descriptor ``attr`` ("direct_fd" or "buffered_fd"), opened by
        ``opener()`` if not yet. Out of descriptors (EMFILE, ENFILE): every idle cached
        descriptor of the process is closed and the open tried once more."""
        fd = getattr(entry, attr)
        if fd is not None:
            return fd
        try:
            fd = opener()
        except OSError as e:
            if e.errno not in _OUT_OF_FDS:
                raise
            shed_idle_everywhere()
            fd = opener()
        with self.lock:
            if getattr(entry, attr) is None:
                setattr(entry, attr, fd)
                return fd
        os.close(fd)  # another thread opened it first
        return getattr(entry, attr)

    def forget(self, path: str) -> None:
        """Close the cached descriptors of ``path`` (before it is renamed or removed)."""
        with self.lock:
            entry = self.files.pop(path, None)
        if entry is not None:
            close_entry(entry)

    def shed_idle(self) -> int:
        """Close every cached file nobody is using; returns how many."""
        with self.lock:
            return self._evict_idle(0)

    def close(self) -> None:
        """Close every descriptor; the cache no longer counts as alive."""
        with _live_lock:
            _live.discard(self)
        with self.lock:
            entries = list(self.files.values())
            self.files.clear()
        for entry in entries:
            close_entry(entry)

    def _evict_idle(self, keep: int) -> int:
        """(Lock held.) Close idle files, least recently used first, until at most ``keep``
        are cached or none is idle; returns how many were closed."""
        closed = 0
        while len(self.files) > keep:
            path = next((p for p, e in self.files.items() if e.users == 0), None)
            if path is None:
                break
            close_entry(self.files.pop(path))
            closed += 1
        return closed


def shed_idle_everywhere() -> int:
    """Close the idle cached descriptors of every live cache of the process (out of
    descriptors); returns how many files were closed."""
    with _live_lock:
        caches = list(_live)
    return sum(cache.shed_idle() for cache in caches)


def close_entry(entry: OpenFile) -> None:
    for attr in ("direct_fd", "buffered_fd"):
        fd = getattr(entry, attr)
        if fd is not None:
            setattr(entry, attr, None)
            try:
                os.close(fd)
            except OSError:
                pass
