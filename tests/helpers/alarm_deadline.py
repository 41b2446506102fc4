"""``alarm_within(seconds)``: fail with ``Blocked``, instead of hanging the suite, when the code
in the block blocks longer (a FIFO opened for reading waits for a writer forever). SIGALRM
interrupts a blocking open or read in the main thread (a thread cannot be stopped, so
helpers.deadline's thread-based ``within`` would leave it blocked); the handler raises, so
the call is not retried. ``Blocked`` is an AssertionError, not an OSError, so code that
ignores I/O errors does not swallow it; it fires again every second in case something does."""

from __future__ import annotations

import contextlib
import signal


class Blocked(AssertionError):
    """The block ran past its deadline."""


@contextlib.contextmanager
def alarm_within(seconds: int):
    def expire(signum, frame):
        raise Blocked(f"blocked for more than {seconds} s")
    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
