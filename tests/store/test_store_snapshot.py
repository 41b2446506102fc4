"""Snapshots taken while the store keeps serving: the copy is the state at snapshot time."""

import threading
import time

import pytest
import torch

from helpers.store_runs import B, make_store, run_steps


def test_snapshot_copies_the_state_of_its_moment_while_a_step_runs(tmp_path):
    with make_store(tmp_path, cpu_budget=4 * B) as s:
        s.register("m", torch.float32, 12 * B // 4)
        s.register("c", torch.int64, B // 8, home="cpu")
        run_steps(s, "m", 2)                      # every element of m is 2 now
        copies, lock = {}, threading.Lock()

        def slow_sink(array, index, start, tensor):
            time.sleep(0.02)                       # let the next step race ahead
            with lock:
                copies[(array, index)] = tensor.clone()

        snap = s.snapshot(slow_sink)
        run_steps(s, "m", 1)                      # changes every bucket to 3
        snap.wait(30)
        assert snap.copied == 12 + 1              # (how many were copied inline: timing)
        for i in range(12):
            assert bool((copies[("m", i)] == 2).all()), f"bucket {i} copied after a change"
        h = s.acquire("m", 0)
        assert float(h.tensor[0]) == 3.0           # the store itself moved on
        s.release(h)


def test_an_acquire_copies_a_pending_bucket_before_handing_it_out(tmp_path):
    with make_store(tmp_path, cpu_budget=4 * B) as s:
        s.register("m", torch.float32, 4 * B // 4)
        run_steps(s, "m", 1)                      # every element is 1
        worker_busy, release_worker = threading.Event(), threading.Event()
        copies, held = {}, []

        def sink(array, index, start, tensor):
            if threading.current_thread().name == "oe-snapshot" and not release_worker.is_set():
                held.append(index)
                worker_busy.set()
                release_worker.wait(30)            # hold the background thread on its first bucket
            copies[index] = (threading.current_thread().name, tensor.clone())

        snap = s.snapshot(sink)
        assert worker_busy.wait(30)
        other = next(i for i in range(4) if i not in held)  # not the one the worker holds
        h = s.acquire("m", other)                  # not copied yet: copied here, first
        assert copies[other][0] != "oe-snapshot" and bool((copies[other][1] == 1).all())
        h.tensor.fill_(7)
        s.release(h, dirty=True)
        release_worker.set()
        snap.wait(30)
        assert snap.copied == 4 and snap.copied_inline >= 1
        assert all(bool((t == 1).all()) for _, t in copies.values())


def test_sink_errors_surface_in_wait(tmp_path):
    with make_store(tmp_path) as s:
        s.register("m", torch.float32, 3 * B // 4)

        def full_disk(array, index, start, tensor):
            raise OSError(28, "No space left on device", "/ckpt/m/c/0")

        snap = s.snapshot(full_disk)
        with pytest.raises(OSError, match="No space left"):
            snap.wait(30)
        s.release(s.acquire("m", 0))               # the store still works


def test_snapshot_refuses_while_handles_are_held(tmp_path):
    with make_store(tmp_path) as s:
        s.register("m", torch.float32, 3 * B // 4)
        h = s.acquire("m", 1)
        with pytest.raises(RuntimeError, match="every handle is released"):
            s.snapshot(lambda *a: None)
        s.release(h)
        s.snapshot(lambda *a: None).wait(30)


def test_kept_buckets_stay_resident_and_do_not_block_a_snapshot(tmp_path):
    with make_store(tmp_path, cpu_budget=4 * B) as s:
        s.register("m", torch.float32, 12 * B // 4)
        run_steps(s, "m", 1)
        kept = s.keep("m", 11)
        assert kept.tensor is None                 # residency only: changes go through acquire
        run_steps(s, "m", 2)                       # 12 buckets through a pool of 4
        assert ("m", 11) in s.resident_buckets()
        copies = {}
        snap = s.snapshot(lambda a, i, start, t: copies.__setitem__(i, t.clone()))
        snap.wait(30)
        assert sorted(copies) == list(range(12)) and bool((copies[11] == 3).all())
        with pytest.raises(ValueError, match="keep"):
            s.release(kept, dirty=True)
        s.release(kept)


def test_wait_returns_only_after_a_copy_by_an_acquire_ends(tmp_path):
    """The background thread can run out of buckets to claim while an acquire still copies
    the last one: the snapshot is finished only when that copy is done too."""
    with make_store(tmp_path, cpu_budget=4 * B) as s:
        s.register("m", torch.float32, 4 * B // 4)
        run_steps(s, "m", 1)
        worker_busy, go_on, copied = threading.Event(), threading.Event(), []

        def sink(array, index, start, tensor):
            if threading.current_thread().name == "oe-snapshot":
                if not worker_busy.is_set():
                    worker_busy.set()
                    copied.append(("worker-first", index))
                    go_on.wait(30)
            else:
                go_on.set()                        # let the worker finish the others now
                time.sleep(0.3)                    # a slow inline write
            copied.append(index)

        snap = s.snapshot(sink)
        assert worker_busy.wait(30)
        first = copied[0][1]
        other = next(i for i in range(4) if i != first)
        user = threading.Thread(target=lambda: s.release(s.acquire("m", other)))
        user.start()
        snap.wait(30)
        assert other in copied, "wait() returned while an acquire was still copying its bucket"
        user.join()
        assert sorted(i for i in copied if isinstance(i, int)) == [0, 1, 2, 3]


def test_a_snapshot_can_start_the_moment_the_previous_one_finished(tmp_path):
    """A save right after an async save (a Ctrl-C handler's) starts its snapshot as soon as
    the previous one's ``wait`` returns: the background thread's hold of the last bucket it
    copied must be gone by then. The let-go is slowed here to widen the window that a
    settle-before-let-go order left open (CI: "snapshot while buckets are held")."""
    with make_store(tmp_path, cpu_budget=4 * B) as s:
        s.register("m", torch.float32, 3 * B // 4)
        run_steps(s, "m", 1)
        let_go = s._let_go_after_snapshot

        def slow_let_go(b, held):
            time.sleep(0.05)
            let_go(b, held)

        s._let_go_after_snapshot = slow_let_go
        for _ in range(3):
            snap = s.snapshot(lambda *a: None)
            snap.wait(30)
            assert snap.copied == 3
        s.snapshot(lambda *a: None).wait(30)  # raised UsageError before the fix


def test_a_ctrl_c_while_a_snapshot_starts_leaves_it_finished_and_the_store_closable(
        tmp_path, monkeypatch):
    """Ctrl-C may land in ``Thread.start`` before the copying thread exists (an async save
    interrupted, signal trials): the snapshot must still count as finished, or the handler's
    save refuses ("still being taken") and ``close`` waits for it for ever."""
    import offload_engine.store.snapshot as snapshot_module

    class NeverStarts(threading.Thread):
        def start(self):
            raise KeyboardInterrupt

    with make_store(tmp_path, cpu_budget=4 * B) as s:
        s.register("m", torch.float32, 3 * B // 4)
        run_steps(s, "m", 1)
        monkeypatch.setattr(snapshot_module.threading, "Thread", NeverStarts)
        with pytest.raises(KeyboardInterrupt):
            s.snapshot(lambda *a: None)
        monkeypatch.undo()
        copied = []
        snap = s.snapshot(lambda array, index, start, tensor: copied.append(index))
        snap.wait(30)
        assert sorted(copied) == [0, 1, 2]
    # the with-block's close returned: it waited for no snapshot that never ran


def test_the_next_snapshot_waits_for_a_failed_one_to_end_its_copies(tmp_path):
    """A snapshot that failed (its save interrupted, its writer closed) only ends the copies
    in flight; the next one (a Ctrl-C handler's save) waits for them instead of being
    refused as "still being taken"."""
    with make_store(tmp_path, cpu_budget=4 * B) as s:
        s.register("m", torch.float32, 3 * B // 4)
        run_steps(s, "m", 1)
        worker_busy, release_worker = threading.Event(), threading.Event()
        held = []

        def failing_sink(array, index, start, tensor):
            if threading.current_thread().name == "oe-snapshot":
                held.append(index)
                worker_busy.set()
                release_worker.wait(30)        # a copy still in flight when it fails
            else:
                raise OSError("the writer was closed")

        first = s.snapshot(failing_sink)
        assert worker_busy.wait(30)
        other = next(i for i in range(3) if i not in held)
        s.release(s.acquire("m", other))       # its inline copy fails the snapshot
        assert first.error is not None and not first.finished.is_set()
        threading.Timer(0.3, release_worker.set).start()
        copied = []
        s.snapshot(lambda array, index, start, tensor: copied.append(index)).wait(30)
        assert first.finished.is_set() and sorted(copied) == [0, 1, 2]
        with pytest.raises(OSError, match="writer was closed"):
            first.wait(0)
