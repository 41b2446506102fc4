"""Sections that an interrupt (Ctrl-C, a SIGTERM handler's ``sys.exit``) cannot cut in half.

Python runs a signal's handler on the main thread between two bytecodes, wherever that
is, and a handler that raises (KeyboardInterrupt, SystemExit) ends whatever ran there. The
store changes its state in several steps under its lock (a victim's buffer goes back to
the pool, then the victim is marked absent); an exception between two of them left a
bucket resident on a buffer the pool had taken back, or a reader waiting for a read that
nobody would report. Guarding each step on its own did not end it: the next random
signal found the next gap.

So, while the main thread is inside a section, the Python handler of each signal that
stops or interrupts a program (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1/2, SIGALRM,
SIGXCPU, SIGVTALRM, SIGPROF: ``_SIGNALS``) is replaced by a recorder; when the outermost
section ends, the handlers are put back and each recorded signal's handler is called
there, in the order the signals came: the exception comes out where the state is whole.
Waits are the other such place: ``InterruptSafeCondition.wait`` calls the recorded
handlers before it waits and waits in slices of ``WAIT_SLICE_S``, answering a signal that
came meanwhile at the end of its slice, so Ctrl-C during a long wait for the disk still
ends it promptly. A section costs about 2 us on the main thread (two sigactions).

Left open: the instant a function is entered. Python checks for signals there too, so a
signal can still land as ``release(handle)`` is called and before its section begins;
the handle then stays held and the next snapshot refuses with "snapshot while buckets are
held" (an error, never a hang or a wrong byte).

Signals left at SIG_DFL or SIG_IGN are not touched: no Python code runs for them (SIGTERM
with no handler ends the process, which the on-disk commit protocol is made for). Other
threads never run Python signal handlers: for them a section is only its lock. A handler
the code inside a section installs (none of ours does) is left in place at the end.
"""

from __future__ import annotations

import _signal
import threading
import time

WAIT_SLICE_S = 0.05  # a signal during a wait inside a section is answered within this

# the signals whose Python handlers are deferred: those that stop or interrupt a program
# (the terminal's, a scheduler's notice before its time limit, timers); scanning every
# signal at each section cost 2 us more per section for handlers nobody makes raise
_SIGNALS = tuple(int(getattr(_signal, name)) for name in (
    "SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGXCPU",
    "SIGVTALRM", "SIGPROF") if hasattr(_signal, name))
_depth = 0          # sections the main thread is in (nested)
_saved: dict = {}   # signal number -> the handler the outermost section replaced
_pending: list = []  # (handler, signal number, frame), in the order received


def _record(signum, frame) -> None:
    # outside a section only if someone saved the recorder as "the old handler" inside one
    # and put it back later: then Ctrl-C still interrupts, other signals are dropped
    handler = _saved.get(signum, _signal.default_int_handler if signum == _signal.SIGINT else None)
    if _depth and handler is not None:
        _pending.append((handler, signum, frame))
    elif handler is not None:
        handler(signum, frame)


def _on_main_thread() -> bool:
    return threading.get_ident() == threading.main_thread().ident


def enter() -> None:
    """Begin a section (nestable). On the main thread, the outermost one replaces every
    Python signal handler by the recorder."""
    global _depth
    if not _on_main_thread():
        return
    _depth += 1
    if _depth == 1:
        _swap_in()


# Python checks for signals after each call, so in the two loops below the handler of a
# signal not yet swapped may run (and raise) between two calls: its exception is kept, to
# come out with the recorded ones, and the loop goes on where it stopped.
def _swap_in() -> None:
    getsignal, setsignal = _signal.getsignal, _signal.signal
    while True:
        try:
            for s in _SIGNALS:
                handler = getsignal(s)
                if handler is not _record and callable(handler):
                    _saved[s] = handler
                    setsignal(s, _record)
            return
        except BaseException as e:  # noqa: BLE001 - re-raised by _deliver
            _pending.append((_reraise, e, None))


def _restore() -> None:
    getsignal, setsignal = _signal.getsignal, _signal.signal
    while True:
        try:
            for s in list(_saved):
                if getsignal(s) is _record:
                    setsignal(s, _saved[s])
                del _saved[s]
            return
        except BaseException as e:  # noqa: BLE001 - re-raised by _deliver
            _pending.append((_reraise, e, None))


def _reraise(e: BaseException, _frame) -> None:
    raise e


def leave() -> None:
    """End a section. The outermost one puts the handlers back and then calls those of the
    signals that came meanwhile (their exception comes out of here)."""
    global _depth
    if not _on_main_thread():
        return
    _depth -= 1
    if _depth == 0:
        _restore()
        _deliver()


def deliver_pending() -> None:
    """Inside a section, at a point where the state is whole: call the handlers of the
    signals that came since it began (a KeyboardInterrupt or SystemExit comes out here)."""
    if _pending and _on_main_thread():
        _deliver()


def _deliver() -> None:
    if not _pending:
        return
    todo = list(_pending)
    _pending.clear()
    _call_in_turn(todo)


def _call_in_turn(todo: list) -> None:
    """Each recorded handler, even when an earlier one raised (the later exceptions then
    carry the earlier ones as their context, as nested handlers would)."""
    handler, signum, frame = todo[0]
    try:
        handler(signum, frame)
    finally:
        if len(todo) > 1:
            _call_in_turn(todo[1:])


def wait_in_slices(wait_once, timeout: float | None = None) -> bool:
    """A wait of the standard library (``event.wait``, a future's) made safe on the main
    thread: ``wait_once(seconds)`` (returns whether the awaited thing happened) is called
    in slices of at most ``WAIT_SLICE_S``, each inside a section, and the handlers of
    signals that came run between slices. Returns whether it happened within ``timeout``
    seconds (None: no limit).

    Why: ``threading.Condition.__enter__`` (under Event and Future) is Python code, and a
    signal's exception raised just after it took its lock leaves the lock taken (a ``with``
    whose ``__enter__`` raised never exits; CPython bpo-29988): the thread that would set
    the event or the future then blocks on that lock for ever. Off the main thread no
    signal handler runs, so the wait is made as it is."""
    if not _on_main_thread():
        return wait_once(timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        remaining = WAIT_SLICE_S if deadline is None else max(
            0.0, min(WAIT_SLICE_S, deadline - time.monotonic()))
        with deferred:
            happened = wait_once(remaining)
            deliver_pending()  # inside an outer section too: a wait is a whole point
        if happened:
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False


class InterruptSafeCondition:
    """A re-entrant lock with its condition, whose ``with`` blocks are sections (above).

    Used like ``threading.Condition(threading.RLock())``: ``with cv:``, ``cv.wait``,
    ``cv.notify_all``."""

    def __init__(self):
        self._cv = threading.Condition(threading.RLock())

    def __enter__(self) -> "InterruptSafeCondition":
        enter()
        try:
            self._cv.__enter__()
        except BaseException:
            leave()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._cv.__exit__(*exc)
        finally:
            leave()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a notify, up to ``timeout`` seconds (None: no limit); returns whether
        one came. Signals recorded before or during the wait get their handlers called
        here, within ``WAIT_SLICE_S`` (the caller holds the lock; the state is whole)."""
        deliver_pending()
        return wait_in_slices(self._cv.wait, timeout)

    def _is_owned(self) -> bool:
        """Whether the calling thread holds the lock (the name threading's locks use)."""
        return self._cv._is_owned()

    def notify(self, n: int = 1) -> None:
        self._cv.notify(n)

    def notify_all(self) -> None:
        self._cv.notify_all()


class _Deferred:
    """``with deferred:`` a section with no lock of its own (around a plain lock's block)."""

    def __enter__(self) -> None:
        enter()

    def __exit__(self, *exc) -> None:
        leave()


deferred = _Deferred()
