"""One thread that runs posted work in order: the store's way of hearing about I/O.

Calls go one way. An I/O worker thread (or the CUDA copy waiter) that finishes a request
only posts the store's handler here and returns; the handler runs on this queue's own
thread (``oe-store`` for the store), which takes the store lock, updates bucket state,
wakes waiters and issues the next reads. So no I/O thread ever waits for the store lock,
and the store never runs its state machine on a thread it does not own.

The thread holds no reference to what it runs between two items, so an owner dropped
without ``close()`` can be collected (its finalizer should call ``stop``).
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
from typing import Callable

from ..io import IOFuture

log = logging.getLogger(__name__)

_STOP = None


class CompletionQueue:
    """A FIFO of calls run one at a time on a daemon thread named ``name``."""

    def __init__(self, name: str):
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=_run, args=(self._queue, name), name=name,
                                        daemon=True)
        self._thread.start()

    def post(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` on the queue's thread, after everything posted before. Never
        blocks; callable from any thread, the queue's own included."""
        self._queue.put((fn, args))

    def stop(self) -> None:
        """Let the thread end once it has run what was posted before (does not wait)."""
        self._queue.put(_STOP)

    def close(self, timeout: float | None = None) -> bool:
        """Run what was posted, then end the thread; wait up to ``timeout`` seconds (None:
        until it ends). Returns whether it ended. Not from the queue's own thread."""
        self.stop()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()


def _run(q: queue.SimpleQueue, name: str) -> None:
    while True:
        item = q.get()
        if item is _STOP:
            return
        fn, args = item
        del item
        try:
            fn(*args)
        except BaseException:  # the thread must outlive a failing handler: waiters rely on it
            log.exception("%s: a posted call failed", name)
        del fn, args  # hold nothing of the owner while idle


def started(on_done, start_io, *args) -> None:
    """Start ``start_io(*args)`` and call ``on_done(future)`` when it ends, however it ends:
    an error raised at the call comes back through the future too, so whoever tracks the
    I/O (a bucket's state, the write-backs in flight that ``flush`` and ``close`` wait for)
    always hears how it ended.

    An interrupt (Ctrl-C's KeyboardInterrupt, SystemExit) raised while the I/O was being
    started ends it as failed with EINTR, marked so that ``interrupted_start`` knows it (the
    store starts such a write-back again on its own thread, where no Ctrl-C lands; a read
    ends as failed and the next acquire reads again), and then goes on to the caller: it
    must never leave the bookkeeping waiting for an I/O that will not report.
    """
    try:
        fut = start_io(*args)
    except Exception as e:  # noqa: BLE001 - it is the I/O's outcome, reported through the future
        fut = failed(e)
    except BaseException as interrupt:
        _interrupted(interrupt).add_done_callback(on_done)
        raise
    fut.add_done_callback(on_done)


def report_unstarted(interrupt: BaseException, on_done) -> None:
    """For the caller of ``started``, in its own ``except BaseException`` around the call
    (and around whatever marked the I/O as in flight before it): an interrupt that landed
    before ``started`` could catch it (at the very call) is reported to ``on_done`` as
    ``started`` would have (failed with EINTR, ``interrupted_start``); one ``started``
    reported already is left alone. Then re-raise it."""
    if not getattr(interrupt, _REPORTED, False):
        _interrupted(interrupt).add_done_callback(on_done)


_REPORTED = "oe_io_reported"  # set on an interrupt once an I/O's on_done heard of it


def _interrupted(interrupt: BaseException) -> IOFuture:
    """The outcome of an I/O whose start ``interrupt`` cut short: failed with EINTR."""
    stopped = OSError(errno.EINTR, f"interrupted ({type(interrupt).__name__}) while the "
                                   f"I/O was being started")
    stopped.__cause__ = interrupt
    stopped.interrupted_start = True  # see interrupted_start()
    setattr(interrupt, _REPORTED, True)
    return failed(stopped)


def interrupted_start(error: BaseException | None) -> bool:
    """True for the outcome ``started`` gives an I/O whose start an interrupt cut short:
    nothing of it failed on the device, so it is retried rather than reported."""
    return getattr(error, "interrupted_start", False)


def failed(error: BaseException) -> IOFuture:
    """A future that ended with ``error``."""
    fut = IOFuture()
    fut.set_running_or_notify_cancel()
    fut.set_exception(error)
    return fut
