"""How long one acquire has waited, and for what: pinned space or the disk.

An acquire that cannot have its bucket at once waits on the store's condition. What it
waits for decides which bound applies and what the error says:

- **the disk**: an I/O is in flight that will bring the bucket or free room (its own read,
  a read ahead that will land and make a victim, a write-back of a victim). A slow disk is
  not the user's fault: these seconds count against ``io_timeout_s`` and end, past it, in
  ``SlowDiskError`` naming the bytes and seconds in flight.
- **pinned space**: nothing in flight, and no bucket can be evicted: the pool is full of
  buckets held by ``acquire()`` without ``release()``. These seconds count against
  ``acquire_timeout_s`` and end in ``PoolExhaustedError`` naming the held buckets.

The store passes the state it sees at each wake (under its lock); this module only keeps
the two clocks and builds the errors (store/errors.py).
"""

from __future__ import annotations

import time

from .bucket import READING, WRITING
from .errors import pool_exhausted, slow_disk


def in_flight(buckets) -> list:
    """Of ``buckets`` (the store's resident set), those with a read or a write-back in
    flight, oldest first."""
    return sorted((b for b in buckets if b.state in (READING, WRITING)), key=lambda b: b.io_since)


class AcquireWait:
    """The two clocks of one acquire of ``bucket`` (seconds, from ``time.monotonic``)."""

    def __init__(self, bucket, space_timeout_s: float, io_timeout_s: float):
        self.bucket = bucket
        self.space_timeout_s = space_timeout_s
        self.io_timeout_s = io_timeout_s
        self.space_s = 0.0   # waited for pinned space with nothing in flight
        self.io_s = 0.0      # waited for I/O in flight
        self.waited = False

    def wait(self, cv, flying: list, held: list, pool) -> None:
        """(Store lock held.) Wait once on ``cv``, counting the time against the disk's
        bound if ``flying`` (the I/Os in flight, ``in_flight``) is not empty, else against
        the pool's; raise the error of a bound already spent. ``held``: the buckets held
        by users now (named by PoolExhaustedError)."""
        if flying:
            remaining = self.io_timeout_s - self.io_s
            if remaining <= 0:
                raise slow_disk(self.bucket, self.io_s, flying, held)
        else:
            remaining = self.space_timeout_s - self.space_s
            if remaining <= 0:
                raise pool_exhausted(self.bucket, self.space_s, pool, held)
        self.waited = True
        t0 = time.monotonic()
        cv.wait(remaining)
        spent = time.monotonic() - t0
        if flying:
            self.io_s += spent
        else:
            self.space_s += spent
