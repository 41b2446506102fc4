"""Errors raised by the I/O layer. Every file error names the file, the byte range and errno."""

from __future__ import annotations

import errno as _errno
import os

from ..errors import OffloadEngineError


class FileIOError(OffloadEngineError, OSError):
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


class WrappedIOError(FileIOError):
    """An I/O error (``cause``) with what was being done when it happened (``context``:
    "read of array m bucket 3", "saving checkpoint gen-000004 on rank 1").

    The one wrapper the layers above use: its ``errno``, ``path``, ``offset`` and
    ``length`` are the cause's, so a caller handles it like the error it wraps.
    Subclasses add named fields (``BucketIOError``, ``CheckpointSaveError``) and are made
    by ``wrap``.
    """

    def __init__(self, context: str, cause: OSError, op: str | None = None):
        super().__init__(cause.errno or 0, op or getattr(cause, "op", None) or "I/O",
                         getattr(cause, "path", None) or cause.filename or "?",
                         getattr(cause, "offset", None), getattr(cause, "length", None),
                         detail=cause.strerror)
        self.context = context
        self.cause = cause

    def __str__(self) -> str:
        return f"{self.context}: {self.cause}"

    def __reduce__(self):  # pickled whole (a rank's error travels to the others)
        return _rebuild, (type(self), self.__dict__.copy(), self.args)

    @classmethod
    def wrap(cls, error: BaseException, *args, **kwargs) -> BaseException:
        """``error`` as ``cls(*args, cause=error, **kwargs)`` when it is an I/O error with an
        errno that is not wrapped yet; any other error as it is (a bug stays a bug)."""
        # Our own FileIOErrors always carry a path worth naming; a bare OSError without an
        # errno is a message (FileExistsError("a file is in the way")), passed on as it is.
        if (isinstance(error, OSError) and not isinstance(error, WrappedIOError)
                and (error.errno or isinstance(error, FileIOError))):
            wrapped = cls(*args, cause=error, **kwargs)
            wrapped.__cause__ = error
            return wrapped
        return error


def _rebuild(cls, state: dict, args: tuple):
    error = cls.__new__(cls, *args)
    OSError.__init__(error, *args)
    error.__dict__.update(state)
    return error


class PoolError(OffloadEngineError, RuntimeError):
    """Base for buffer-pool errors."""


class RequestTooLargeError(PoolError, ValueError):
    """A request that can never fit in the pool's budget; raised at once, never after a wait."""


class PoolExhaustedError(PoolError, TimeoutError):
    """No space freed up in time: the pool's budget is held by buffers not yet released."""
