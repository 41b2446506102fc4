"""One consolidation at a time into an output folder.

``flock`` on the output folder itself (as the store's write lock, ``store/lock.py``): the
kernel drops it when the process dies, so a killed run never leaves a stale lock, and no
lock file is left among the files a user uploads. A second run into the same folder is
refused with the holder's pid and host (from ``/proc/locks`` where the system has it).

Where the file system cannot flock a folder (NFS emulates flock with a byte-range lock that
needs a descriptor open for writing, which a folder cannot give: EBADF; Lustre without
``-o flock``: ENOSYS), the run goes on unguarded with a warning: a lock file would be left
in the folder that is uploaded as the model, and the publish stays crash-safe either way.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os

from ..errors import OffloadEngineError
from ..io import syscalls
from ..io.errors import FileIOError
from ..store.lock import _describe_holder

log = logging.getLogger(__name__)
# errnos of a file system that cannot flock a folder (see the module's docstring)
_NO_LOCKS = frozenset({errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


class OutputLockedError(OffloadEngineError, RuntimeError):
    """Another run is writing an export into the same output folder."""


class OutputLock:
    """``with OutputLock(out_dir):`` holds ``out_dir`` (an existing folder) for one writer."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self._fd: int | None = None

    def __enter__(self) -> "OutputLock":
        try:
            fd = syscalls.open_fd(self.out_dir, os.O_RDONLY | os.O_DIRECTORY | syscalls.CLOEXEC)
        except OSError as e:
            raise FileIOError(e.errno, "open", self.out_dir) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in _NO_LOCKS:
                os.close(fd)
                log.warning("%s: the file system cannot lock this folder (%s); nothing stops "
                            "a second consolidation into it", self.out_dir, e.strerror)
                return self
            holder = _describe_holder(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise FileIOError(e.errno, "lock", self.out_dir) from e
            raise OutputLockedError(
                f"{self.out_dir}: another consolidation is writing into this folder "
                f"({holder}); one run at a time per output folder") from None
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
