"""SIGTERM handled like Ctrl-C: the command stops where it is and its clean-up runs.

Python's default for SIGTERM ends the process at once, skipping every ``finally``: a
consolidation killed by a scheduler's time limit left its staging folder in OUT. Inside
``sigterm_raises()`` a SIGTERM raises ``Terminated`` in the main thread instead (a
``BaseException``, like ``KeyboardInterrupt``, so no ``except Exception`` swallows it);
the command turns it into exit code 143 (128 + 15, what a shell reports for a process
SIGTERM ended). A second SIGTERM during the clean-up ends the process at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading

EXIT_TERMINATED = 128 + signal.SIGTERM


class Terminated(BaseException):
    """The process received SIGTERM (raised in the main thread by ``sigterm_raises``)."""


@contextlib.contextmanager
def sigterm_raises():
    """Within the block, SIGTERM raises ``Terminated`` in the main thread (elsewhere, where
    no handler can be installed, nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the next one ends the process
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
