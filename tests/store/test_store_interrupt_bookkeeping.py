"""Ctrl-C (KeyboardInterrupt, or SIGTERM's SystemExit) landing inside an acquire leaves no
bucket held and is never swallowed (issue 30: BaseException-safe bookkeeping). Before the
fix an interrupt in an acquire's copy for a snapshot, or in its wait while the snapshot
thread copied the bucket, left the bucket held with no handle: every later snapshot (the
interrupt handler's checkpoint) failed with "snapshot while buckets are held"; and an
interrupt in that copy was recorded as the snapshot's error and not raised."""

import threading

import pytest
import torch

from helpers.deadline import within
from helpers.store_runs import B, make_store, run_steps
from offload_engine.store.bucket import Handle
from offload_engine.store.errors import SnapshotInterruptedError
from offload_engine.store.snapshot import Snapshot


def held_snapshot(store, interrupt=KeyboardInterrupt):
    """A snapshot whose background thread sits on its first bucket until ``go`` is set, and
    whose copies on the test's thread (an acquire's) meet ``interrupt``."""
    busy, go, held = threading.Event(), threading.Event(), []

    def sink(array, index, start, tensor):
        if threading.current_thread().name == "oe-snapshot" and not go.is_set():
            held.append(index)
            busy.set()
            go.wait(30)
        elif threading.current_thread() is threading.main_thread():
            raise interrupt()  # Ctrl-C while the acquire copies the bucket

    snap = store.snapshot(sink)
    assert busy.wait(30)
    return snap, go, held


@pytest.mark.parametrize("signal_exception", [KeyboardInterrupt, SystemExit])
def test_ctrl_c_in_an_acquires_copy_fails_the_snapshot_and_holds_nothing(tmp_path,
                                                                         signal_exception):
    with make_store(tmp_path, cpu_budget=4 * B) as s:
        s.register("m", torch.float32, 4 * B // 4)
        run_steps(s, "m", 1)
        snap, go, held = held_snapshot(s, signal_exception)
        other = next(i for i in range(4) if i not in held)
        with pytest.raises(signal_exception):
            s.acquire("m", other)          # copies `other` first: the interrupt lands there
        go.set()
        with pytest.raises(SnapshotInterruptedError, match=f"m bucket {other}"):
            snap.wait(30)
        # nothing stays held: a new snapshot (the handler's checkpoint) starts and ends
        copies = {}
        s.snapshot(lambda a, i, start, t: copies.__setitem__(i, t.clone())).wait(30)
        assert sorted(copies) == [0, 1, 2, 3] and all(bool((t == 1).all()) for t in copies.values())


def test_ctrl_c_while_an_acquire_waits_for_the_snapshot_thread_holds_nothing(tmp_path,
                                                                             monkeypatch):
    with make_store(tmp_path, cpu_budget=4 * B) as s:
        s.register("m", torch.float32, 4 * B // 4)
        run_steps(s, "m", 1)
        snap, go, held = held_snapshot(s)
        original = Snapshot.before_use

        def interrupted(self, bucket, cv):  # Ctrl-C in the wait for the thread's copy
            raise KeyboardInterrupt

        monkeypatch.setattr(Snapshot, "before_use", interrupted)
        with pytest.raises(KeyboardInterrupt):
            s.acquire("m", held[0])
        monkeypatch.setattr(Snapshot, "before_use", original)
        go.set()
        snap.wait(30)
        s.snapshot(lambda *a: None).wait(30)   # refused before: the bucket stayed held
        h = s.acquire("m", held[0])
        assert bool((h.tensor == 1).all())
        s.release(h)


@pytest.mark.parametrize("call", ["acquire", "keep"])
def test_ctrl_c_as_the_handle_is_made_holds_nothing(tmp_path, monkeypatch, call):
    with make_store(tmp_path, cpu_budget=4 * B) as s:
        s.register("m", torch.float32, 4 * B // 4)
        run_steps(s, "m", 1)

        class Interrupting:  # the handle's `keep` attribute is written: Ctrl-C lands there
            def __set__(self, obj, value):
                raise KeyboardInterrupt

        monkeypatch.setattr(Handle, "keep", Interrupting(), raising=False)
        with pytest.raises(KeyboardInterrupt):
            getattr(s, call)("m", 0)
        monkeypatch.undo()
        s.snapshot(lambda *a: None).wait(30)   # refused before: the bucket stayed held


def interrupt_at_the_call_of_started(monkeypatch):
    """The store's first call of ``started`` (the one that starts an I/O and reports its
    outcome) meets Ctrl-C at the call itself, before ``started`` can catch anything."""
    import offload_engine.store.tiered_store as tiered_store
    real, fired = tiered_store.started, []

    def interrupted(*args):
        if not fired and threading.current_thread() is threading.main_thread():
            fired.append(True)
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(tiered_store, "started", interrupted)
    return fired


def test_ctrl_c_at_the_start_of_a_read_leaves_no_bucket_reading_forever(tmp_path, monkeypatch):
    with make_store(tmp_path, cpu_budget=2 * B, prefetch_depth=0) as s:
        s.register("m", torch.float32, 4 * B // 4)
        run_steps(s, "m", 1)   # every bucket written home: acquiring 0 and 1 again reads them
        s.flush()
        for i in (2, 3):
            s.release(s.acquire("m", i))
        fired = interrupt_at_the_call_of_started(monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            s.acquire("m", 0)
        assert fired
        monkeypatch.undo()
        h = within(30, lambda: s.acquire("m", 0))  # hung: the bucket stayed "reading"
        assert bool((h.tensor == 1).all())
        s.release(h)


def test_ctrl_c_at_the_start_of_a_write_back_leaves_flush_working(tmp_path, monkeypatch):
    s = make_store(tmp_path, cpu_budget=2 * B, prefetch_depth=0)
    s.register("m", torch.float32, 4 * B // 4)
    fired = interrupt_at_the_call_of_started(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        for i in range(4):   # the third acquire writes a dirty bucket back to make room
            h = s.acquire("m", i)
            h.tensor.fill_(i + 1)
            s.release(h, dirty=True)
    assert fired
    monkeypatch.undo()
    within(30, s.flush)   # hung: the write-back counted in flight never reported
    for i in range(2):
        h = s.acquire("m", i)
        assert bool((h.tensor == i + 1).all()), (i, h.tensor[:2])
        s.release(h)
    within(30, s.close)


def test_ctrl_c_between_claiming_a_bucket_for_a_snapshot_and_copying_it(tmp_path, monkeypatch):
    """The acquire claimed the bucket for the snapshot, and Ctrl-C lands before its copy
    starts: before the fix the bucket stayed "being saved" and the next acquire of it (the
    handler's own save reading the state) waited forever, as did the snapshot."""
    with make_store(tmp_path, cpu_budget=4 * B) as s:
        s.register("m", torch.float32, 4 * B // 4)
        run_steps(s, "m", 1)
        snap, go, held = held_snapshot(s)
        other = next(i for i in range(4) if i not in held)
        copy = Snapshot.copy

        def interrupted(self, bucket, inline):
            if inline:
                raise KeyboardInterrupt  # at the call, before the copy's own try
            return copy(self, bucket, inline)

        monkeypatch.setattr(Snapshot, "copy", interrupted)
        with pytest.raises(KeyboardInterrupt):
            s.acquire("m", other)
        monkeypatch.undo()
        go.set()
        with pytest.raises(SnapshotInterruptedError, match=f"m bucket {other}"):
            within(30, lambda: snap.wait(30))
        h = within(30, lambda: s.acquire("m", other))
        assert bool((h.tensor == 1).all())
        s.release(h)
        s.snapshot(lambda *a: None).wait(30)
