"""Errors raised by the I/O layer. Every file error names the file, the byte range and errno."""

from __future__ import annotations

import errno as _errno
import os


class FileIOError(OSError):
    """A read, write, open, sync or preallocation that failed.

    Attributes: ``errno``, ``strerror``, ``path``, ``op`` ("read", "write", "open", ...),
    ``offset`` and ``length`` (bytes; None where they do not apply).
    """

    def __init__(self, err: int, op: str, path: str, offset: int | None = None,
                 length: int | None = None, detail: str | None = None):
        strerror = detail or (os.strerror(err) if err else "error")
        super().__init__(err, strerror, path)
        self.op = op
        self.path = path
        self.offset = offset
        self.length = length

    def __reduce__(self):  # pickled whole (a rank's error travels to the others)
        return type(self), (self.errno, self.op, self.path, self.offset, self.length,
                            self.strerror)

    def __str__(self) -> str:
        where = ""
        if self.length is not None:
            where = f" of {self.length} bytes"
        if self.offset is not None:
            where += f" at offset {self.offset}"
        code = _errno.errorcode.get(self.errno, str(self.errno)) if self.errno else "no errno"
        return f"{self.op}{where} in {self.path} failed: {self.strerror} ({code})"


class TruncatedFileError(FileIOError):
    """A read reached end of file before all requested bytes arrived (a short or truncated file)."""


class PoolError(RuntimeError):
    """Base for buffer-pool errors."""


class RequestTooLargeError(PoolError, ValueError):
    """A request that can never fit in the pool's budget; raised at once, never after a wait."""


class PoolExhaustedError(PoolError, TimeoutError):
    """No space freed up in time: the pool's budget is held by buffers not yet released."""
