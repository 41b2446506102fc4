"""The store's errors about buckets: which array and bucket, on top of the file error or
the pool's."""

from __future__ import annotations

from ..io.errors import PoolExhaustedError, WrappedIOError


class BucketIOError(WrappedIOError):
    """A read or write-back of one bucket that failed (a full disk, a failing device).

    Still a ``FileIOError`` (an ``OSError``): ``errno``, ``path`` (the chunk file),
    ``offset`` and ``length`` are those of the I/O error it wraps (``cause``); ``array``
    and ``bucket`` say whose bytes they were. A failed write-back keeps the bytes in
    memory, dirty (docs/store.md, "Faults").
    """

    def __init__(self, op: str, array: str, bucket: int, cause: OSError):
        super().__init__(f"{op} of array {array} bucket {bucket} failed", cause, op=op)
        self.array = array
        self.bucket = bucket


def for_bucket(op: str, bucket, error: BaseException) -> BaseException:
    """``error`` as a BucketIOError naming ``bucket``'s array and index, when it is an I/O
    error (other errors are returned as they are)."""
    return BucketIOError.wrap(error, op, bucket.array.name, bucket.index)


def pool_exhausted(bucket, timeout_s: float, pool, held: int) -> PoolExhaustedError:
    """The error of an acquire of ``bucket`` that found no pinned space in ``pool`` within
    ``timeout_s`` seconds while ``held`` buckets were held."""
    return PoolExhaustedError(
        f"acquire of {bucket.array.name} bucket {bucket.index} ({bucket.nbytes} bytes): no "
        f"pinned space freed within {timeout_s:.1f} s; {pool.in_use} of {pool.capacity} bytes "
        f"in use, {held} buckets held by acquire() without release(). Release handles sooner "
        "or raise cpu_budget.")
