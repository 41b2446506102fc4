"""Exclusive write lock on a store directory.

``flock`` on ``<dir>/.offload-engine.lock`` (released by the kernel when the process dies, so
a crash never leaves a stale lock). The holder writes its pid, host and start time into the
file so a refused second writer can say who holds it. Readers never take the lock.

The file has a fixed name in a directory others may write to, so it is opened without
following a symlink and without truncating (O_NOFOLLOW, no O_TRUNC), and refused unless it
is a regular file with no other hard link: a link planted there must never make the store
empty or overwrite the file it points to. The holder's details are written only into a
lock file this user owns.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time

from ..io import syscalls
from ..io.errors import FileIOError

LOCK_NAME = ".offload-engine.lock"
_HOLDER_BYTES = 4096  # the most read of a lock file to say who holds it


class StoreLockedError(RuntimeError):
    """Another process (or another store object) holds the store directory for writing."""


class LockFileError(RuntimeError):
    """The lock file path holds something that is not a plain lock file (a symlink, a
    directory, a FIFO, a file with other hard links): refused, never written through."""


class WriteLock:
    """Hold the write lock of ``directory`` until ``release()``."""

    def __init__(self, directory: str):
        self.directory = directory
        self.path = os.path.join(directory, LOCK_NAME)
        self._fd = None
        fd = _open_lock_file(self.path)
        try:
            st = os.fstat(fd)
            _check_lock_file(self.path, st)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise StoreLockedError(
                f"store directory {directory} is already open for writing by "
                f"{self._describe_holder()}; a store has one writer at a time "
                f"(readers such as `offload-engine inspect` are not affected)") from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        # a file another user owns (made before us) keeps its bytes: we only lock it
        self._owned = st.st_uid == os.geteuid()
        if self._owned:
            info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                               "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode()
            try:
                syscalls.ftruncate(fd, 0, self.path)
                syscalls.pwrite(fd, info, 0, self.path)
            except OSError:
                pass  # who holds the lock is a courtesy to a refused writer; the lock holds

    def _describe_holder(self) -> str:
        try:
            raw = syscalls.read_all(self.path, _HOLDER_BYTES,
                                    flags=syscalls.NOFOLLOW | os.O_NONBLOCK)
            info = json.loads(raw[:_HOLDER_BYTES])
            return f"process {info['pid']} on {info['host']} (since {info['since']})"
        except (OSError, ValueError, KeyError, TypeError):
            return "another process"

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                if self._owned:
                    syscalls.ftruncate(fd, 0, self.path)
            except OSError:
                pass  # the lock is released below whatever happens to the courtesy note
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)


def _open_lock_file(path: str) -> int:
    """The lock file's descriptor: created if absent, never truncated, never through a
    symlink; O_NONBLOCK so that a FIFO planted there cannot block the open."""
    try:
        return syscalls.open_fd(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK
                                | syscalls.NOFOLLOW | syscalls.CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise LockFileError(f"{path}: the store's lock file is a symbolic link; refusing "
                                f"to open it (a lock file is a plain file the store makes "
                                f"itself: remove the link)") from None
        if e.errno == errno.EISDIR:
            raise LockFileError(f"{path}: the store's lock file is a directory; refusing to "
                                f"use it") from None
        raise FileIOError(e.errno, "open", path) from e


def _check_lock_file(path: str, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise LockFileError(f"{path}: the store's lock file is not a regular file (mode "
                            f"{stat.filemode(st.st_mode)}); refusing to use it")
    if st.st_nlink != 1:
        raise LockFileError(f"{path}: the store's lock file has {st.st_nlink} hard links "
                            f"(another name points at the same file); refusing to write to it")
