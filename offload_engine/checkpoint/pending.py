"""A checkpoint generation being written in the background, and the guard that keeps the
next optimizer step from changing parameters before they are written."""

from __future__ import annotations

import logging
import threading
import time
from ..errors import OperationTimeoutError
from ..interrupts import deferred, wait_in_slices

log = logging.getLogger(__name__)

PENDING_ATTR = "_oe_pending_checkpoint"   # on the optimizer: its save in progress
HOOKED_ATTR = "_oe_checkpoint_hook"


class PendingCheckpoint:
    """Returned by ``save_checkpoint_async``. ``wait()`` blocks until the generation is
    committed (on every rank: rank 0 commits, the others see the commit) and returns its
    directory; it raises what went wrong, and the generation then stays uncommitted
    (``<gen>.partial``, never loaded)."""

    def __init__(self, path: str, step: int):
        self.path = path                      # the generation's directory once committed
        self.step = step
        self.params_written = threading.Event()
        # filled in as it goes (docs/checkpoint.md): seconds, bytes, buckets
        self.stats: dict = {"step_waited_s": 0.0, "inline_copies": 0, "state_buckets": 0}
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._t0 = time.perf_counter()
        # the save's work (save.py sets it); taken once, by its thread or by the first waiter
        # when Ctrl-C kept that thread from starting: a waiter never waits for nobody
        self._body = None
        self._claim = threading.Lock()

    def done(self) -> bool:
        """Whether the save ended (committed or failed); never blocks."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> str:
        """Block until committed; returns the generation's directory."""
        self._execute()
        if not wait_in_slices(self._finished.wait, timeout):
            raise OperationTimeoutError(f"{self.path}: checkpoint not committed after {timeout} s")
        if self._error is not None:
            raise self._error
        return self.path

    # -- used by save.py ------------------------------------------------------------------
    def _run(self) -> None:
        """Run the save's body (``_body``) on its own thread."""
        # not a daemon: a script that ends right after saving still commits its checkpoint.
        # Started in a section: Thread.start waits on an Event, and a signal there could
        # leave the new thread blocked before it runs, and the interpreter's exit waiting
        # for it (interrupts.wait_in_slices)
        with deferred:
            threading.Thread(target=self._execute, name="oe-checkpoint").start()

    def _execute(self) -> None:
        """Run the save's body if nobody has taken it yet (else return at once); however it
        ends, the save counts as finished. An interrupt on the caller's thread fails the
        save and goes on to the caller."""
        body = None
        try:
            with self._claim:
                body, self._body = self._body, None
            if body is not None:
                body()
        except BaseException as e:  # re-raised by wait()
            if body is None:
                raise
            self._error = e
            if not isinstance(e, Exception):
                raise
        finally:
            if body is not None:
                with deferred:  # both set, whatever signal comes: waiters rely on them
                    self.params_written.set()  # never leave a step waiting on a failed save
                    self.stats["seconds"] = time.perf_counter() - self._t0
                    self._finished.set()


def wait_for_params(optimizer, *_args, **_kwargs) -> None:
    """Step pre-hook: the step changes parameters in place, so it first waits until a
    save in progress has written them (usually long done: forward and backward ran)."""
    pending = getattr(optimizer, PENDING_ATTR, None)
    if pending is not None and not pending.params_written.is_set():
        t0 = time.perf_counter()
        pending._execute()  # its thread never started (Ctrl-C): the save runs here
        wait_in_slices(pending.params_written.wait)
        pending.stats["step_waited_s"] += time.perf_counter() - t0


def guard(optimizer, pending: PendingCheckpoint) -> None:
    """Make ``pending`` the optimizer's save in progress; hook its steps once."""
    setattr(optimizer, PENDING_ATTR, pending)
    if not getattr(optimizer, HOOKED_ATTR, False):
        optimizer.register_step_pre_hook(wait_for_params)
        setattr(optimizer, HOOKED_ATTR, True)


def finish_previous(optimizer) -> None:
    """Wait for the optimizer's save in progress, if any (one at a time: the store takes
    one snapshot at a time). Its failure is logged, not raised: it belongs to that save's
    own ``wait()``, and the new save may well succeed (a disk that was full, now freed).
    An interrupt while waiting (Ctrl-C, SIGTERM's SystemExit) goes on to the caller: it is
    no failure of that save, and swallowing it kept a run going that was told to stop."""
    pending = getattr(optimizer, PENDING_ATTR, None)
    if pending is None:
        return
    pending._execute()  # its thread never started (Ctrl-C): the save runs here
    wait_in_slices(pending._finished.wait)
    if pending._error is not None:
        log.warning("the previous checkpoint (%s) failed: %s", pending.path, pending._error)
