"""Point-in-time copies of store arrays, taken while training goes on (copy-on-acquire).

``TieredStore.snapshot(sink)`` records which buckets must be copied and returns at once. A
background thread hands each bucket's bytes to ``sink`` (reading it from NVMe if needed).
If a user acquires a bucket that has not been copied yet, the acquire copies it first, so
the copy always holds the bytes as they were when ``snapshot`` was called: the next
optimizer step can run while a checkpoint is written, and no extra memory beyond the
pinned pool is used.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable

import torch
from ..errors import OperationTimeoutError

# sink(array_name, bucket_index, start_element, tensor): write the bucket's bytes somewhere
Sink = Callable[[str, int, int, torch.Tensor], None]


class Snapshot:
    """One snapshot in progress. ``wait()`` blocks until every bucket went to the sink.

    A bucket is claimed once, by the background thread or by a user's acquire, and counts
    as settled when its copy ends (or, after an error, when it will never be claimed): the
    snapshot is finished when all are settled, not when the background thread runs out of
    buckets to claim (an acquire may still be copying the last one).

    The thread copies in the order of the step to come, so it runs ahead of that step. Once
    a user has caught up with it (waited for a bucket it was copying), following it would
    make every acquire wait for the thread's copy of that very bucket; the thread then takes
    the buckets from the other end instead, and the step copies those it reaches first
    itself: each side copies, neither waits for the other.
    """

    def __init__(self, buckets: list, sink: Sink):
        self.sink = sink
        # in schedule order, claimed ones dropped from the front as met; store lock guards both
        self.pending = collections.deque(buckets)
        self.pending_set = set(buckets)
        self.total = len(buckets)
        self.copied = 0
        self.copied_inline = 0             # copied by a user's acquire (copy-on-acquire)
        self.error: BaseException | None = None
        self.caught_up = False             # a user waited for the thread's copy (store lock)
        self.finished = threading.Event()
        self._settled = 0
        self._count_lock = threading.Lock()
        if not buckets:
            self.finished.set()

    def take(self, bucket) -> bool:
        """Claim ``bucket`` for copying (caller holds the store lock)."""
        if bucket not in self.pending_set or self.error is not None:
            return False
        self.pending_set.discard(bucket)
        return True

    def next_bucket(self):
        """The next unclaimed bucket for the background thread (caller holds the store lock):
        in order, preferring ones already in memory (no read); from the back once a user
        caught up."""
        while self.pending and self.pending[0] not in self.pending_set:
            self.pending.popleft()
        while self.pending and self.pending[-1] not in self.pending_set:
            self.pending.pop()
        if not self.pending or self.error is not None:
            return None
        if self.caught_up:
            chosen = self.pending[-1]
        else:
            chosen = next((b for b in self.pending if b.buf is not None and b in self.pending_set),
                          self.pending[0])
        self.pending_set.discard(chosen)
        return chosen

    def copy(self, bucket, tensor: torch.Tensor, inline: bool) -> None:
        try:
            self.sink(bucket.array.name, bucket.index, bucket.start, tensor)
        except BaseException as e:  # recorded; wait() raises it
            self.fail(e)
            self.settle(1)
        else:
            with self._count_lock:
                self.copied += 1
                self.copied_inline += int(inline)
            self.settle(1)

    def fail(self, error: BaseException) -> None:
        """Record the first error; no bucket is claimed after it."""
        with self._count_lock:
            if self.error is None:
                self.error = error

    def abandon_unclaimed(self) -> None:
        """After an error (caller holds the store lock): the buckets nobody claimed never will
        be; count them settled so that ``wait()`` returns once the claimed ones are done."""
        n = len(self.pending_set)
        self.pending_set.clear()
        self.pending.clear()
        self.settle(n)

    def settle(self, n: int) -> None:
        """Count ``n`` claimed or abandoned buckets as done with."""
        with self._count_lock:
            self._settled += n
            if self._settled >= self.total:
                self.finished.set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until done; raise the sink's first error (for example a full disk)."""
        if not self.finished.wait(timeout):
            raise OperationTimeoutError(f"snapshot not finished after {timeout} s "
                               f"({self.copied} of {self.total} buckets copied)")
        if self.error is not None:
            raise self.error
