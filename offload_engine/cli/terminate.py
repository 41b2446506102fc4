"""SIGTERM handled like Ctrl-C: the command stops where it is and its clean-up runs.

Python's default for SIGTERM ends the process at once, skipping every ``finally``: a
consolidation killed by a scheduler's time limit left its staging folder in OUT. Under
``until_sigterm`` a SIGTERM raises ``_Terminated`` in the main thread instead (a
``BaseException``, like ``KeyboardInterrupt``, so no ``except Exception`` on the way
swallows it), and the command ends with exit code 143 (128 + 15, what a shell reports for a
process SIGTERM ended). A second SIGTERM during the clean-up ends the process at once.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Callable

EXIT_TERMINATED = 128 + signal.SIGTERM


class _Terminated(BaseException):
    """SIGTERM arrived (raised in the main thread; never leaves this module)."""


def until_sigterm(run: Callable[[], int], message: str) -> int:
    """``run()``, or, when SIGTERM arrives first, its clean-up, ``message`` on stderr and
    ``EXIT_TERMINATED``. Off the main thread, where no handler can be installed, just
    ``run()``."""
    if threading.current_thread() is not threading.main_thread():
        return run()

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the next one ends the process
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        return run()
    except _Terminated:
        print(message, file=sys.stderr)
        return EXIT_TERMINATED
    finally:
        signal.signal(signal.SIGTERM, previous)
