"""A real signal (Ctrl-C's SIGINT, SIGTERM with a handler that calls sys.exit) landing in
the middle of the store's bookkeeping: while it gives an evicted bucket's buffer back to
the pool, takes one, picks a victim, offers a candidate or queues an I/O. Before the store
lock became an interrupt-safe section (offload_engine/interrupts.py), the exception came
out right there: a bucket stayed resident on a buffer the pool had taken back ("use of a
pooled buffer after release" at the next acquire, the signal trials' handler failing to
save) or an acquire waited for a read nobody would report. Now the store call finishes its
change and the exception comes out of it; every byte written before is still there."""

import os
import signal
import sys
import threading

import pytest
import torch

from helpers.deadline import within
from helpers.store_runs import B, make_store
from offload_engine.io.extents import Extents
from offload_engine.io.file_io import AsyncFileIO
from offload_engine.store.policy import ResidencyPolicy

POINTS = {  # where the signal lands: (class, method)
    "pool gives a buffer back": (Extents, "give"),
    "pool takes a buffer": (Extents, "take"),
    "victim chosen": (ResidencyPolicy, "choose_victim"),
    "candidate offered": (ResidencyPolicy, "offer"),
    "I/O queued": (AsyncFileIO, "_submit"),
}
BUCKETS = 8


@pytest.fixture(params=["SIGINT", "SIGTERM"])
def signal_and_exception(request):
    if request.param == "SIGINT":
        yield signal.SIGINT, KeyboardInterrupt
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    yield signal.SIGTERM, SystemExit
    signal.signal(signal.SIGTERM, previous)


def signal_once_inside(monkeypatch, cls, name, signum, after_calls):
    """The ``after_calls``-th call of ``cls.name`` on the main thread sends ``signum`` to
    this process from inside it (the handler runs at the next bytecode it may)."""
    real, calls, fired = getattr(cls, name), [0], []

    def landing(*args, **kwargs):
        if threading.current_thread() is threading.main_thread() and not fired:
            calls[0] += 1
            if calls[0] >= after_calls:
                fired.append(True)
                os.kill(os.getpid(), signum)
        return real(*args, **kwargs)

    monkeypatch.setattr(cls, name, landing)
    return fired


@pytest.mark.parametrize("point", sorted(POINTS))
@pytest.mark.parametrize("after_calls", [1, 5])
def test_a_signal_inside_the_stores_bookkeeping_comes_out_after_it(
        tmp_path, monkeypatch, signal_and_exception, point, after_calls):
    signum, exception = signal_and_exception
    added = [0] * BUCKETS  # +1s each bucket received (counted once the handle was ours)
    with make_store(tmp_path, cpu_budget=3 * B, prefetch_depth=1) as s:
        s.register("m", torch.float32, BUCKETS * B // 4)

        def one_step(write=True):  # a read-only step evicts clean victims on this thread
            for i in range(BUCKETS):
                h = s.acquire("m", i)
                if write:
                    h.tensor.add_(1)
                    added[i] += 1
                s.release(h, dirty=write)

        one_step()  # every bucket written home once: eviction and reads from here on
        fired = signal_once_inside(monkeypatch, *POINTS[point], signum, after_calls)
        came_out = None
        try:
            for step in range(6):
                one_step(write=step % 2 == 0)
        except BaseException as e:  # noqa: BLE001 - checked below
            came_out = e
        assert fired, f"the signal never landed at {point}"
        assert isinstance(came_out, exception), repr(came_out)
        monkeypatch.undo()
        within(60, one_step)  # the store goes on: no bucket on a freed buffer, no lost read

        def read_all():
            out = []
            for i in range(BUCKETS):
                h = s.acquire("m", i)
                out.append(h.tensor.clone())
                s.release(h)
            return out

        got = within(60, read_all)
        assert [float(t.min()) for t in got] == [float(n) for n in added]
        assert [float(t.max()) for t in got] == [float(n) for n in added]
        within(60, s.flush)
    with make_store(tmp_path, cpu_budget=3 * B) as s:  # and on disk, after close
        s.register("m", torch.float32, BUCKETS * B // 4)
        for i in range(BUCKETS):
            h = s.acquire("m", i)
            assert bool((h.tensor == added[i]).all()), f"bucket {i} after reopening"
            s.release(h)
