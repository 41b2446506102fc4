"""The store's I/O errors: which array and bucket, on top of the file error."""

from __future__ import annotations

from ..io.errors import FileIOError


class BucketIOError(FileIOError):
    """A read or write-back of one bucket that failed (a full disk, a failing device).

    Still a ``FileIOError`` (an ``OSError``): ``errno``, ``path`` (the chunk file),
    ``offset`` and ``length`` are those of the I/O error it wraps (``cause``); ``array``
    and ``bucket`` say whose bytes they were. A failed write-back keeps the bytes in
    memory, dirty (docs/store.md, "Faults").
    """

    def __init__(self, op: str, array: str, bucket: int, cause: OSError):
        super().__init__(cause.errno or 0, op, getattr(cause, "path", None) or cause.filename
                         or "?", getattr(cause, "offset", None), getattr(cause, "length", None),
                         detail=cause.strerror)
        self.array = array
        self.bucket = bucket
        self.cause = cause

    def __str__(self) -> str:
        return f"{self.op} of array {self.array} bucket {self.bucket} failed: {self.cause}"

    def __reduce__(self):
        return type(self), (self.op, self.array, self.bucket, self.cause)


def for_bucket(op: str, bucket, error: BaseException) -> BaseException:
    """``error`` as a BucketIOError naming ``bucket``'s array and index, when it is an I/O
    error (other errors are returned as they are)."""
    if isinstance(error, OSError) and not isinstance(error, BucketIOError):
        wrapped = BucketIOError(op, bucket.array.name, bucket.index, error)
        wrapped.__cause__ = error
        return wrapped
    return error
