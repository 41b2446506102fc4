"""What a file request is and what it returns: ``IOFuture`` (the byte count, awaitable from
asyncio), ``Request`` (one read or write in flight, cut into pieces) and ``IOStats`` (the
counters of an ``AsyncFileIO``). Kept apart from file_io.py, which runs requests, so readers
of the request's life need not read the thread pool."""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass, field

from ..interrupts import deferred, wait_in_slices


class IOFuture(concurrent.futures.Future):
    """A ``concurrent.futures.Future`` that can also be awaited from asyncio.

    Its result is the number of bytes moved.
    """

    # waits and callbacks that a signal on the main thread cannot leave holding the
    # future's lock, which the I/O thread that completes it would then wait on for ever
    # (interrupts.wait_in_slices says how)
    def result(self, timeout: float | None = None):
        self._wait(timeout)
        with deferred:
            return super().result(0)

    def exception(self, timeout: float | None = None):
        self._wait(timeout)
        with deferred:
            return super().exception(0)

    def add_done_callback(self, fn) -> None:
        with deferred:
            super().add_done_callback(fn)

    def _wait(self, timeout: float | None) -> None:
        if not wait_in_slices(self._done_within, timeout):
            raise concurrent.futures.TimeoutError(f"I/O not done after {timeout} s")

    def _done_within(self, seconds: float) -> bool:
        try:
            super().exception(seconds)
        except concurrent.futures.TimeoutError:
            return False
        return True

    def __await__(self):
        import asyncio  # here: 20 ms of start-up that only asyncio users should pay
        return asyncio.wrap_future(self).__await__()

    @classmethod
    def gather(cls, futures: list[concurrent.futures.Future]) -> "IOFuture":
        """One future for many: completes when all do; result is the summed byte count;
        the first error (in list order) is raised."""
        out = cls()
        out.set_running_or_notify_cancel()
        if not futures:
            out.set_result(0)
            return out
        remaining = [len(futures)]
        lock = threading.Lock()

        def done(_):
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            for f in futures:
                if f.exception() is not None:
                    out.set_exception(f.exception())
                    return
            out.set_result(sum(f.result() for f in futures))

        for f in futures:
            f.add_done_callback(done)
        return out

    @classmethod
    def completed(cls, nbytes: int = 0) -> "IOFuture":
        """A future already done with result ``nbytes``."""
        out = cls()
        out.set_running_or_notify_cancel()
        out.set_result(nbytes)
        return out


@dataclass
class IOStats:
    """Counters since creation or the last ``reset`` (bytes and request counts)."""

    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    direct_pieces: int = 0
    buffered_pieces: int = 0
    syncs: int = 0
    # seconds during which at least one read (write) request was in flight: bytes over busy
    # seconds is the throughput achieved, whatever the gaps between requests
    read_busy_s: float = 0.0
    write_busy_s: float = 0.0


@dataclass
class Request:
    """One read, write or sync in flight: its pieces left (``pending``), the first error,
    and the future its caller holds."""

    op: str  # "read" | "write"
    path: str
    offset: int
    view: memoryview
    future: IOFuture
    sync: bool
    pending: int = 0
    error: BaseException | None = None
    keepalive: object = None
    lock: threading.Lock = field(default_factory=threading.Lock)
