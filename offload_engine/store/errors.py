"""The store's errors about buckets: which array and bucket, on top of the file error or
the pool's."""

from __future__ import annotations

import time

from ..errors import OffloadEngineError, OperationTimeoutError
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


class SnapshotInterruptedError(OffloadEngineError, RuntimeError):
    """A snapshot's copy of a bucket was cut short by an interrupt (Ctrl-C, SystemExit)
    landing in the acquire that copied it: the snapshot fails (its checkpoint is not
    committed) and the interrupt goes on to the caller."""


class SlowDiskError(OperationTimeoutError):
    """An acquire waited longer than ``io_timeout_s`` for I/O in flight (the bucket's own
    read, or reads and write-backs that would free pinned space): the disk is slow or
    stalled. Nothing the user holds is the cause; ``in_flight`` lists ``(op, array, bucket,
    bytes, seconds)`` of each I/O that was in flight."""

    def __init__(self, message: str, in_flight: list):
        super().__init__(message)
        self.in_flight = in_flight


def _names(buckets, most: int = 4) -> str:
    listed = ", ".join(f"{b.array.name} bucket {b.index}" for b in buckets[:most])
    return listed + (f" and {len(buckets) - most} more" if len(buckets) > most else "")


def slow_disk(bucket, waited_s: float, flying: list, held: list) -> SlowDiskError:
    """The error of an acquire of ``bucket`` that waited ``waited_s`` seconds for the I/Os
    ``flying`` (buckets reading or writing, oldest first) while ``held`` were lent out."""
    now = time.monotonic()
    rows = [("read" if b.state == "reading" else "write-back", b.array.name, b.index,
             b.nbytes, now - b.io_since) for b in flying]
    oldest = ", ".join(f"{op} of {name} bucket {i} ({n} bytes, {s:.1f} s)"
                       for op, name, i, n, s in rows[:4])
    more = f" and {len(rows) - 4} more" if len(rows) > 4 else ""
    also = (f" ({len(held)} buckets are held by acquire() too, which is not the cause: "
            f"{_names(held)})" if held else "")
    return SlowDiskError(
        f"acquire of {bucket.array.name} bucket {bucket.index} ({bucket.nbytes} bytes): waited "
        f"{waited_s:.1f} s for the disk, past io_timeout_s; {len(rows)} I/Os of "
        f"{sum(r[3] for r in rows)} bytes in flight, oldest first: {oldest}{more}. The disk "
        f"is slow or stalled{also}: check the device, or raise io_timeout_s.", rows)


def pool_exhausted(bucket, timeout_s: float, pool, held: list) -> PoolExhaustedError:
    """The error of an acquire of ``bucket`` that found no pinned space in ``pool`` within
    ``timeout_s`` seconds with no I/O in flight while the buckets ``held`` were lent out."""
    head = (f"acquire of {bucket.array.name} bucket {bucket.index} ({bucket.nbytes} bytes): no "
            f"pinned space freed within {timeout_s:.1f} s; {pool.in_use} of {pool.capacity} "
            f"bytes in use")
    if not held:  # nothing the user can release: not a cpu_budget matter either
        return PoolExhaustedError(
            f"{head}, yet no bucket is held and no I/O is in flight (the store could not "
            f"choose a victim); please report this with the store's config.")
    return PoolExhaustedError(
        f"{head}, {len(held)} buckets held by acquire() without release(): {_names(held)}. "
        f"Release handles sooner or raise cpu_budget.")
