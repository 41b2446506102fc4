"""Keep the page cache out of disk measurements, and check that it stayed out.

``evict`` drops files from the page cache the only way an unprivileged process can:
fdatasync first (POSIX_FADV_DONTNEED skips dirty pages), then posix_fadvise(DONTNEED).
``resident_bytes`` asks the kernel (mincore) how much of a file is still cached, so a
benchmark can prove its reads came from the device.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from . import syscalls
from .errors import FileIOError


def evict_and_check(paths) -> int:
    """``evict`` then ``resident_bytes``: what is still cached (should be 0)."""
    paths = list(paths)
    evict(paths)
    return resident_bytes(paths)


def evict(paths) -> None:
    """Drop files from the page cache: fdatasync (DONTNEED skips dirty pages), then
    posix_fadvise(POSIX_FADV_DONTNEED). Directories are walked."""
    for path in paths:
        if os.path.isdir(path):
            for root, _dirs, files in os.walk(path):
                evict(os.path.join(root, f) for f in files)
            continue
        fd = syscalls.open_fd(path, os.O_RDONLY | syscalls.CLOEXEC)
        try:
            syscalls.fdatasync(fd, path)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(paths) -> int:
    """Bytes of ``paths`` (files; directories are walked) now in the page cache (mincore)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    total = 0
    for path in paths:
        if os.path.isdir(path):
            total += resident_bytes(os.path.join(root, f)
                                    for root, _dirs, files in os.walk(path) for f in files)
            continue
        size = os.path.getsize(path)
        if not size:
            continue
        fd = syscalls.open_fd(path, os.O_RDONLY | syscalls.CLOEXEC)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), "mmap failed", path)
            try:
                vec = (ctypes.c_ubyte * (-(-size // page)))()
                if libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), "mincore failed", path)
                total += int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * page
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return total


def sync_tree(path: str) -> None:
    """fdatasync every file under ``path`` and fsync every directory in it. A failure is a
    FileIOError naming the file (a write the device could not complete surfaces here)."""
    for root, _dirs, files in os.walk(path):
        for name in files + ["."]:
            file = os.path.join(root, name)
            try:
                fd = syscalls.open_fd(file, os.O_RDONLY | syscalls.CLOEXEC)
            except OSError as e:
                raise FileIOError(e.errno, "open", file) from e
            try:
                if name == ".":
                    syscalls.fsync(fd, file)
                else:
                    syscalls.fdatasync(fd, file)
            except OSError as e:
                raise FileIOError(e.errno, "fsync", file) from e
            finally:
                os.close(fd)
