"""Exclusive write lock on a store directory.

``flock`` on the store directory itself (a descriptor opened with O_DIRECTORY), released by
the kernel when the process dies, so a crash never leaves a stale lock. No file is made:
a lock file inside the directory was an object zarr-python did not know, and it warned
about it on every traversal of the store. A refused second writer names the holder from
the kernel's own table of locks (``/proc/locks``, by the directory's device and inode),
where the system has one. Readers never take the lock.

Stores written before this lock kept a ``.offload-engine.lock`` file in the directory. It
is locked (a writer of that version may still hold it: then the store is refused) and
removed; anything at that name that is not a plain file with one link (a symlink, a hard
link, a FIFO, a directory planted there) is refused and left alone, never opened through.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat

from ..io import syscalls
from ..io.errors import FileIOError
from ..errors import OffloadEngineError

LEGACY_LOCK_NAME = ".offload-engine.lock"  # the lock file of stores written before 2026-12-02
_PROC_LOCKS = "/proc/locks"
_PROC_LOCKS_BYTES = 1 << 20  # the most read of /proc/locks to name a holder


class StoreLockedError(OffloadEngineError, RuntimeError):
    """Another process (or another store object) holds the store directory for writing."""


class LockFileError(OffloadEngineError, RuntimeError):
    """The old lock file's name holds something that is not a plain lock file (a symlink, a
    directory, a FIFO, a file with other hard links): refused, never opened through."""


class WriteLock:
    """Hold the write lock of ``directory`` until ``release()``."""

    def __init__(self, directory: str):
        self.directory = directory
        self._fd = None
        try:
            fd = syscalls.open_fd(directory, os.O_RDONLY | os.O_DIRECTORY | syscalls.CLOEXEC)
        except OSError as e:
            raise FileIOError(e.errno, "open", directory) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _describe_holder(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise FileIOError(e.errno, "lock", directory) from e
            raise StoreLockedError(
                f"store directory {directory} is already open for writing by {holder}; a "
                f"store has one writer at a time (readers such as `offload-engine inspect` "
                f"are not affected)") from None
        try:
            _retire_legacy_lock(directory)
        except BaseException:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


def _describe_holder(fd: int) -> str:
    """Who holds the flock on ``fd``'s inode, by the kernel's lock table (Linux), else
    "another process". The table lists each lock's pid and ``major:minor:inode``."""
    try:
        st = os.fstat(fd)
        raw = syscalls.read_all(_PROC_LOCKS, _PROC_LOCKS_BYTES)
    except OSError:
        return "another process"
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    for line in raw.decode("ascii", "replace").splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 4242 08:01:1234 0 EOF"; a blocked waiter has "->"
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        try:
            major, minor, inode = fields[5].split(":")
            if (int(major, 16), int(minor, 16), int(inode)) == want:
                return f"process {int(fields[4])} on {socket.gethostname()}"
        except ValueError:
            continue
    return "another process"


def _retire_legacy_lock(directory: str) -> None:
    """Remove the lock file an earlier version left in ``directory`` (see the module's
    docstring); StoreLockedError if a writer of that version still holds it."""
    path = os.path.join(directory, LEGACY_LOCK_NAME)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise LockFileError(f"{path}: an old lock file's name holds something that is not a "
                            f"regular file (mode {stat.filemode(st.st_mode)}); refusing to "
                            f"use the store (the store made no such thing: remove it)")
    if st.st_nlink != 1:
        raise LockFileError(f"{path}: an old lock file has {st.st_nlink} hard links (another "
                            f"name points at the same file); refusing to use the store "
                            f"(remove it)")
    try:
        fd = syscalls.open_fd(path, os.O_RDONLY | os.O_NONBLOCK | syscalls.NOFOLLOW
                              | syscalls.CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno == errno.ELOOP:  # replaced by a link since lstat
            raise LockFileError(f"{path}: an old lock file is a symbolic link; refusing to "
                                f"open it (remove it)") from None
        raise FileIOError(e.errno, "open", path) from e
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise FileIOError(e.errno, "lock", path) from e
            raise StoreLockedError(
                f"store directory {directory} is already open for writing by an earlier "
                f"offload-engine (it holds {path}); a store has one writer at a time") from None
        try:
            syscalls.unlink(path)  # removes the name only: never a link's target
        except FileNotFoundError:
            pass
        except OSError as e:
            raise FileIOError(e.errno, "remove", path) from e
    finally:
        os.close(fd)
