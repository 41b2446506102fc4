"""The suite's markers are checked while each test runs, not trusted (a pytest plugin; tests/conftest.py
loads it):

- ``multiprocess``: a test without it that starts any other process (``subprocess``, a
  ``multiprocessing`` or ``torch.multiprocessing`` process, torchrun, ``os.fork``, ``os.system``,
  ``os.posix_spawn``) fails at that call, with the marker to add.
- ``slow``: a test without it that moves more than 1 GiB (bytes read plus bytes written by this
  process, and written by the child processes it waited for) fails at its end, with the marker
  to add.

So ``-m "not slow and not multiprocess"`` is what it says. Bytes: this process's are the larger
of what its read/write calls moved (``read_chars``, which counts page-cache hits) and what reached
the device (``read_bytes``, which counts mmap faults and direct I/O); children's are the bytes
they wrote (``getrusage(RUSAGE_CHILDREN)`` blocks, the only count kept after a child exits, which
counts a write when it dirties the page cache). Their reads are not counted: what reaches the
device there includes every child's loading of Python and torch (which says nothing about the
test), and reads the page cache serves would not be counted anyway.
``OE_TEST_SLOW_BYTES`` changes the limit (bytes; for the test of this guard).
"""

from __future__ import annotations

import multiprocessing.process
import os
import resource
import subprocess
import sys
from dataclasses import dataclass, field

import psutil
import pytest

GIB = 1 << 30
SLOW_BYTES = int(os.environ.get("OE_TEST_SLOW_BYTES", GIB))
BLOCK = 512  # bytes: the unit of ru_inblock / ru_oublock on Linux


@dataclass
class Running:
    """The test running now: its item, whether it may start processes, and its byte counters at
    the start."""
    item: pytest.Item
    may_start_processes: bool
    start: tuple[int, int]
    violations: list[str] = field(default_factory=list)


_running: Running | None = None


def bytes_moved() -> tuple[int, int]:
    """(read, written) in bytes so far, by this process, and written by its waited-for children."""
    io = psutil.Process().io_counters()
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (max(io.read_chars, io.read_bytes),
            max(io.write_chars, io.write_bytes) + kids.ru_oublock * BLOCK)


def slow_violation(nodeid: str, start: tuple[int, int], end: tuple[int, int],
                   limit: int = SLOW_BYTES) -> str | None:
    """The failure message when a test not marked slow moved more than ``limit`` bytes between
    the counters ``start`` and ``end`` ((read, written) bytes), else None."""
    read, written = end[0] - start[0], end[1] - start[1]
    if read + written <= limit:
        return None
    return (f"{nodeid} moved {(read + written) / GIB:.2f} GiB (read {read / GIB:.2f}, written "
            f"{written / GIB:.2f}; this process, and its children's writes) but is not marked "
            f"@pytest.mark.slow: add the marker (tests/helpers/marker_guard.py checks it; the limit "
            f"is {limit / GIB:.2f} GiB)")


def process_violation(nodeid: str, what: str) -> str:
    """The failure message when a test not marked multiprocess starts a process by ``what``."""
    return (f"{nodeid} started a process ({what}) but is not marked @pytest.mark.multiprocess: "
            f"add the marker (tests/helpers/marker_guard.py checks it)")


def _check_process_start(what: str) -> None:
    running = _running
    if running is None or running.may_start_processes:
        return
    message = process_violation(running.item.nodeid, what)
    running.violations.append(message)  # reported at the end too, should the test catch this
    pytest.fail(message, pytrace=False)


def _guarded(original, describe):
    def start(*args, **kwargs):
        _check_process_start(describe(*args, **kwargs))
        return original(*args, **kwargs)
    start.__wrapped__ = original
    return start


def _install() -> None:
    """Wrap every way a test can start a process (once per interpreter)."""
    if getattr(subprocess.Popen._execute_child, "__wrapped__", None) is not None:
        return
    subprocess.Popen._execute_child = _guarded(
        subprocess.Popen._execute_child, lambda self, args, *a, **k: f"subprocess {args!r}"[:200])
    base = multiprocessing.process.BaseProcess
    base.start = _guarded(base.start, lambda self: f"multiprocessing {type(self).__name__} "
                                                   f"target={getattr(self, '_target', None)!r}")
    for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            original = getattr(os, name)
            wrapper = _guarded(original, lambda *a, _n=name, **k: f"os.{_n}")
            # pickled by reference as before (posix.system): tests pickle these on purpose
            wrapper.__module__, wrapper.__qualname__ = original.__module__, original.__qualname__
            setattr(os, name, wrapper)
            setattr(sys.modules[original.__module__], name, wrapper)


def pytest_configure(config) -> None:
    _install()


def _report(running: Running) -> None:
    """Fail the current phase with what the test did that its markers do not allow."""
    if running.violations:
        message = "\n".join(dict.fromkeys(running.violations))
        running.violations.clear()
        pytest.fail(message, pytrace=False)
    if running.item.get_closest_marker("slow") is None:
        message = slow_violation(running.item.nodeid, running.start, bytes_moved())
        if message:
            running.start = bytes_moved()  # reported once
            pytest.fail(message, pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    global _running
    _running = Running(item, item.get_closest_marker("multiprocess") is not None, bytes_moved())
    try:
        return (yield)
    except BaseException:
        _running.violations.clear()  # the setup failed already, on this or on something else
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        result = yield
    except BaseException:
        if _running is not None:
            _running.violations.clear()  # the test failed already, on this or on something else
        raise
    if _running is not None and _running.item is item:
        _report(_running)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    global _running
    try:
        result = yield
    except BaseException:
        _running = None
        raise
    running, _running = _running, None
    if running is not None and running.item is item:
        _report(running)
    return result
