"""Test-only fault injection: make chosen file system calls of the engine fail.

Every file system call of the store and of checkpoint saving goes through
``io/syscalls.py``, which first calls ``point(kind, path)``. Disarmed (always, outside
tests) that is one global read and one comparison. A test arms a ``FaultPlan``::

    plan = FaultPlan(kind="write", nth=3, errno=errno.ENOSPC, under=str(tmp_path))
    with injected(plan):
        ...          # the third write under tmp_path raises OSError(ENOSPC); later ones succeed
    plan.injected    # [(kind, site, path)] of every fault raised

A fault raises the ``OSError`` the real call would raise (errno, strerror, path) instead
of making the call, so nothing reaches the disk: what a full disk (ENOSPC) or a failing
device (EIO) does to that one call. A plan with ``delay_s`` makes its calls slow instead:
each due call sleeps that long and then runs (a slow or stalled disk). Every plan also counts the calls it sees by kind and
by site (the engine function that made the call, e.g. ``io.file_io._loop``), so a test
can list the call sites of a scenario and then aim at each of them.

The plan is process-wide and seen by every thread: never arm one outside a test.
"""

from __future__ import annotations

import collections
import errno as _errno
import os
import sys
import threading
import time
from ..errors import InputError, UsageError

# what a call does, as FaultPlan.kind names it
KINDS = ("open", "read", "write", "sync", "allocate", "truncate", "rename", "mkdir",
         "remove", "link")

_plan: "FaultPlan | None" = None
_HERE = ("offload_engine.io.faults", "offload_engine.io.syscalls")


def point(kind: str, path) -> None:
    """Called by io/syscalls.py before each call: raises the armed plan's fault, if due."""
    plan = _plan
    if plan is not None:
        plan.hit(kind, path)


class FaultPlan:
    """Which calls fail, and a count of every call seen.

    Args:
        kind: fail only calls of this kind (one of ``KINDS``); None: any kind.
        site: fail only calls made by this engine function (``"io.file_io._loop"``); None: any.
        nth: the first call to fail, counting (from 1) the calls that match ``kind``,
            ``site`` and ``under``; 0 fails nothing (the plan only counts).
        errno: the error number raised (``errno.ENOSPC``, ``errno.EIO``, ...).
        times: how many matching calls fail from the ``nth`` on; None: every one after it
            (a disk that stays full).
        under: only calls on paths under this directory are counted or failed (the test's
            own directory: pytest and torch write files too).
        delay_s: when > 0, a due call is delayed this many seconds and then made, rather
            than failed (a slow disk); ``errno`` is not used.
        label: ``label(path) -> str`` names what a path is (say "checkpoint chunk"); the
            site then is ``function@label``, so that one function serving several callers
            (the I/O threads write store buckets and checkpoint chunks alike) counts as
            one site per kind of file.
    """

    def __init__(self, *, kind: str | None = None, site: str | None = None, nth: int = 1,
                 errno: int = _errno.ENOSPC, times: int | None = 1, under: str | None = None,
                 label=None, delay_s: float = 0.0):
        if kind is not None and kind not in KINDS:
            raise InputError(f"unknown fault kind {kind!r}; one of {KINDS}")
        self.kind, self.site, self.nth, self.errno, self.times = kind, site, nth, errno, times
        self.under = None if under is None else os.path.join(os.path.abspath(under), "")
        self.label = label
        self.delay_s = delay_s
        self.calls: collections.Counter = collections.Counter()  # (kind, site) -> calls seen
        self.injected: list[tuple[str, str, str]] = []            # (kind, site, path) failed
        self._matching = 0
        self._lock = threading.Lock()

    def hit(self, kind: str, path) -> None:
        path = os.path.abspath(os.fspath(path))
        if self.under is not None and not (path + os.sep).startswith(self.under):
            return
        site = _caller_site()
        if self.label is not None:
            site = f"{site}@{self.label(path)}"
        with self._lock:
            self.calls[(kind, site)] += 1
            if self.kind not in (None, kind) or self.site not in (None, site):
                return
            self._matching += 1
            n = self._matching - self.nth
            fail = self.nth > 0 and n >= 0 and (self.times is None or n < self.times)
            if fail:
                self.injected.append((kind, site, path))
        if fail and self.delay_s > 0:
            time.sleep(self.delay_s)  # a slow disk: the call runs, late
        elif fail:
            raise OSError(self.errno, os.strerror(self.errno), path)

    def sites(self) -> set[tuple[str, str]]:
        """The (kind, site) pairs of every call seen so far."""
        return set(self.calls)


class injected:
    """``with injected(plan):`` arms ``plan`` for the block (one plan at a time)."""

    def __init__(self, plan: FaultPlan):
        self.plan = plan

    def __enter__(self) -> FaultPlan:
        arm(self.plan)
        return self.plan

    def __exit__(self, *exc) -> None:
        disarm()


def arm(plan: FaultPlan) -> None:
    """Make ``plan`` the process's fault plan (tests only)."""
    global _plan
    if _plan is not None and _plan is not plan:
        raise UsageError("a fault plan is already armed")
    _plan = plan


def disarm() -> None:
    """No more faults: every call runs as it is."""
    global _plan
    _plan = None


def _caller_site() -> str:
    """``package.module.function`` of the engine code that made the call (the first frame
    outside this module and syscalls.py)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") in _HERE:
        frame = frame.f_back
    if frame is None:
        return "?"
    module = frame.f_globals.get("__name__", "?").removeprefix("offload_engine.")
    return f"{module}.{frame.f_code.co_name}"
