"""Point-in-time copies of store arrays, taken while training goes on (copy-on-acquire).

``TieredStore.snapshot(sink)`` records which buckets must be copied and returns at once. A
background thread hands each bucket's bytes to ``sink`` (reading it from NVMe if needed).
If a user acquires a bucket that has not been copied yet, the acquire copies it first, so
the copy always holds the bytes as they were when ``snapshot`` was called: the next
optimizer step can run while a checkpoint is written, and no extra memory beyond the
pinned pool is used.

The store lends a snapshot what it needs as a ``SnapshotBuckets`` (its lock, and calls to
hold a bucket in memory, to read its bytes and to let it go); the thread, the order of the
copies and the hand-over of each bucket to the sink are here.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
from ..errors import OperationTimeoutError, UsageError
from ..interrupts import InterruptSafeCondition, deferred, wait_in_slices
from .errors import SnapshotInterruptedError

# sink(array_name, bucket_index, start_element, tensor): write the bucket's bytes somewhere
Sink = Callable[[str, int, int, torch.Tensor], None]


@dataclass(frozen=True)
class SnapshotBuckets:
    """What a snapshot needs from its store (TieredStore makes one per snapshot)."""

    cv: threading.Condition  # the store lock: a snapshot's claims are made under it
    # (store lock held) keep the bucket in memory and held, reading it if needed; on failure
    # undo the hold and raise
    hold: Callable
    # (no lock) the bucket's bytes as they are now, for the sink
    bytes_of: Callable
    # (takes the store lock) the copy of the bucket ended, users may change it again;
    # ``held=True``: also end the hold of ``hold``
    let_go: Callable


def check_can_start(current: "Snapshot | None", held: list) -> None:
    """Refuse (UsageError) a new snapshot while ``current`` is still being taken, or while
    buckets are lent out (``held``: their keys, sorted): it is taken between steps."""
    if current is not None and not current.finished.is_set():
        raise UsageError("a snapshot of this store is still being taken")
    if held:
        raise UsageError(f"snapshot while buckets are held ({held[:3]}...): take it "
                         "between steps, when every handle is released")


def wait_out_failed(current: "Snapshot | None", cv: threading.Condition, timeout_s: float) -> None:
    """(Store lock held.) A snapshot that failed (its save was interrupted by Ctrl-C, its
    writer closed) claims nothing more and only ends the copies in flight: wait up to
    ``timeout_s`` for them, so that the next save (a Ctrl-C handler's) is not refused as
    "still being taken". ``cv.wait`` lets the store lock go meanwhile."""
    deadline = time.monotonic() + timeout_s
    while (current is not None and current.error is not None and not current.finished.is_set()
           and time.monotonic() < deadline):
        cv.wait(0.05)  # polled: a copy settles after its let-go's notify


def claim_order(scheduled: list, wanted: list) -> list:
    """The order to copy the ``wanted`` buckets (every bucket of the arrays, array by
    array): first in the order of ``scheduled`` (the next step's), so that step rarely finds
    one still to copy (a copy on the training thread), then the rest as listed."""
    want = set(wanted)
    order = [b for b in scheduled if b in want]
    taken = set(order)
    return order + [b for b in wanted if b not in taken]


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

    def __init__(self, buckets: list, sink: Sink, store: SnapshotBuckets):
        self.sink = sink
        self.store = store
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
        self._count_lock = InterruptSafeCondition()  # counts never left half updated
        if not buckets:
            self.finished.set()

    def before_use(self, bucket, cv: threading.Condition) -> bool:
        """(Store lock held, in an acquire that holds ``bucket``.) Wait while the thread
        copies ``bucket`` (the user caught up with it); then claim it if it is still to be
        copied: True means the caller copies it first (``copy(bucket, inline=True)``).
        The claim is ``bucket.saving`` set to the caller's thread id, made before anything
        else: an acquire that Ctrl-C ends before its copy finds it and ``abandon``s it."""
        while bucket.saving:
            self.caught_up = True
            cv.wait()
        if bucket not in self.pending_set or self.error is not None:
            return False
        bucket.saving = threading.get_ident()
        self.pending_set.discard(bucket)
        return True

    def abandon(self, bucket, interrupt: BaseException) -> None:
        """(Store lock held.) An acquire claimed ``bucket`` (``before_use``) and an
        interrupt ended it before the copy ran: the snapshot fails, the bucket settles."""
        self.pending_set.discard(bucket)
        bucket.saving = False
        self.fail(SnapshotInterruptedError(
            f"snapshot interrupted ({type(interrupt).__name__}) before copying "
            f"{bucket.array.name} bucket {bucket.index}"))
        self.settle(1)

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

    def start(self) -> None:
        """(Store lock held.) Copy the buckets on a background thread, ``oe-snapshot``.

        A Ctrl-C that ends ``start`` (it may land before the thread exists) fails the
        snapshot and settles every bucket, so that it counts as finished: a ``close`` or the
        next snapshot would otherwise wait for a thread that never ran. No bucket can be
        claimed yet: the thread claims under the store lock, which the caller holds."""
        try:
            with deferred:  # Thread.start waits on an Event (interrupts.wait_in_slices)
                threading.Thread(target=self._work, name="oe-snapshot", daemon=True).start()
        except BaseException as e:
            self.fail(SnapshotInterruptedError(
                f"snapshot interrupted ({type(e).__name__}) while it started"))
            self.abandon_unclaimed()
            raise

    def copy(self, bucket, inline: bool) -> None:
        """Hand ``bucket``'s bytes to the sink (it is claimed and marked saving). An inline
        copy runs in the acquire that holds it; the thread's copy holds it itself and lets
        it go here.

        The bucket is let go before it counts as settled: ``finished`` is what a caller
        waits for before the next snapshot, which refuses one while any bucket is held, so
        the last bucket's hold must be gone by then (a save right after an async one)."""
        copied = False
        try:
            tensor = self.store.bytes_of(bucket)
            self.sink(bucket.array.name, bucket.index, bucket.start, tensor)
            copied = True
        except BaseException as e:  # the claimed bucket must settle, or wait() never ends
            if isinstance(e, Exception):
                self.fail(e)  # recorded; wait() raises it, the user's acquire goes on
            else:  # Ctrl-C (or SystemExit) in an acquire's copy: the copy fails, and the
                # interrupt goes on to the user; never swallowed as the sink's error
                self.fail(SnapshotInterruptedError(
                    f"snapshot interrupted ({type(e).__name__}) while copying "
                    f"{bucket.array.name} bucket {bucket.index}"))
                if inline:
                    raise
        finally:
            with deferred:  # let go and settled together: a signal never leaves one undone
                try:
                    self.store.let_go(bucket, held=not inline)
                finally:
                    if copied:
                        with self._count_lock:
                            self.copied += 1
                            self.copied_inline += int(inline)
                    self.settle(1)

    def _work(self) -> None:
        cv = self.store.cv
        try:
            while True:
                with cv:
                    b = self.next_bucket()
                    if b is None:
                        break
                    b.saving = True  # users wait before changing it (acquire)
                    try:
                        self.store.hold(b)
                    except BaseException as e:  # the finally below abandons the rest
                        b.saving = False
                        self.fail(e)
                        self.settle(1)  # the bucket it had claimed
                        cv.notify_all()
                        break
                self.copy(b, inline=False)
        except BaseException as e:  # never leave wait() hanging
            self.fail(e)
        finally:
            with cv:
                if self.error is not None:
                    self.abandon_unclaimed()

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
        if not wait_in_slices(self.finished.wait, timeout):
            raise OperationTimeoutError(f"snapshot not finished after {timeout} s "
                               f"({self.copied} of {self.total} buckets copied)")
        if self.error is not None:
            raise self.error
