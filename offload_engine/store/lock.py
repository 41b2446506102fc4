"""Exclusive write lock on a store directory.

``flock`` on ``<dir>/.offload-engine.lock`` (released by the kernel when the process dies, so
a crash never leaves a stale lock). The holder writes its pid, host and start time into the
file so a refused second writer can say who holds it. Readers never take the lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

LOCK_NAME = ".offload-engine.lock"


class StoreLockedError(RuntimeError):
    """Another process (or another store object) holds the store directory for writing."""


class WriteLock:
    """Hold the write lock of ``directory`` until ``release()``."""

    def __init__(self, directory: str):
        self.directory = directory
        self.path = os.path.join(directory, LOCK_NAME)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise StoreLockedError(
                f"store directory {directory} is already open for writing by "
                f"{self._describe_holder()}; a store has one writer at a time "
                f"(readers such as `offload-engine inspect` are not affected)") from None
        self._fd = fd
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)

    def _describe_holder(self) -> str:
        try:
            with open(self.path) as f:
                info = json.load(f)
            return f"process {info['pid']} on {info['host']} (since {info['since']})"
        except (OSError, ValueError, KeyError):
            return "another process"

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.ftruncate(fd, 0)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
