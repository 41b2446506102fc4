"""The GPU tier's ordering rules, on the CPU: TieredStore with a stand-in device.

No GPU is lent to CI, so the store's CUDA paths (staging a pinned bucket for a CUDA user,
copying it back, the copy waiter thread, reusable events, gpu-home buckets, snapshots of
both) run here against ``StandInDevice``: its "device memory" is a CPU tensor and its side
stream really is asynchronous: a copy enqueued on it runs only when someone waits for an
event recorded after it (a host ``synchronize``, or the compute stream's ``wait_event``,
which a CUDA user's kernels would be ordered by). Whoever reads bytes before the copy that
fills them has run reads stale ones, as on a GPU. The device also checks the rules that
only a host synchronize makes safe on a real GPU (the compute stream's wait does not stop
the host): a write-back starts only after the host waited for the copy-out into its
buffer, and a pinned buffer goes back to the pool only after the host waited for every
copy-in that read it. tools/gpu_check.py runs the same paths on a real GPU.
"""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from offload_engine.errors import InputError, UsageError
from offload_engine.store import TieredStore
from offload_engine.store.gpu_staging import GpuStaging
from offload_engine.store.lock import WriteLock

B = 4096            # bucket bytes
N = B // 4          # float32 elements per bucket
GARBAGE = 0xAB      # what the stand-in's device memory holds before anything is copied in


class _Op:
    __slots__ = ("pos", "kind", "dst", "src", "nbytes", "run")

    def __init__(self, pos, kind, dst, src, nbytes, run):
        self.pos, self.kind, self.dst, self.src, self.nbytes, self.run = \
            pos, kind, dst, src, nbytes, run


class StandInStream:
    """A FIFO of copies that run only when waited for (up to an event's mark)."""

    def __init__(self, device, compute: bool = False):
        self.device = device
        self.compute = compute
        self.ops: list[_Op] = []      # every op ever enqueued, in order
        self.executed = 0             # ops[:executed] have run
        self.host_synced = 0          # ops[:host_synced] are known done by the host
        self._lock = threading.RLock()

    def enqueue(self, kind, dst, src) -> None:
        with self._lock:
            self.ops.append(_Op(len(self.ops), kind, dst.data_ptr(), src.data_ptr(),
                                dst.numel() * dst.element_size(), lambda: dst.copy_(src)))

    def mark(self) -> int:
        with self._lock:
            return len(self.ops)

    def run_until(self, mark: int) -> None:
        with self._lock:
            while self.executed < mark:
                self.ops[self.executed].run()
                self.executed += 1

    def wait_stream(self, other) -> None:
        if self.compute:  # compute waits for every copy queued on the side stream so far
            other.run_until(other.mark())
            self.device.note("compute_waits_side")
        else:  # the compute stand-in runs on the host as issued: nothing of it is pending
            assert other.compute
            self.device.note("side_waits_compute")

    def wait_event(self, event) -> None:
        # the compute stream waits for a copy-in on the "GPU": kernels issued after this
        # see its bytes. Not a host wait: host_synced does not move.
        assert self.compute
        event.stream.run_until(event.at)
        self.device.note("compute_waits", event.id)


class StandInEvent:
    _ids = itertools.count()

    def __init__(self, device):
        self.device = device
        self.id = next(self._ids)
        self.stream = None
        self.at = 0

    def record(self, stream) -> None:
        self.stream, self.at = stream, stream.mark()
        self.device.note("record", self.id)

    def synchronize(self) -> None:
        self.device.syncs.append((threading.current_thread().name, self.device.lock_held()))
        s = self.stream
        with s._lock:
            s.run_until(self.at)
            s.host_synced = max(s.host_synced, self.at)
        self.device.note("host_sync", self.id)


class StandInDevice:
    """The operations GpuStaging uses (gpu_staging.CudaDevice's), on the CPU."""

    def __init__(self, fail_empty: bool = False):
        self.fail_empty = fail_empty
        self.compute = StandInStream(self, compute=True)
        self.side: list[StandInStream] = []
        self.arena = None
        self.log: list = []     # (thread name, what, ...) in the order things were issued
        self.syncs: list = []   # (thread name, whether it held the store lock)
        self.store_lock = None

    def note(self, *what) -> None:
        self.log.append((threading.current_thread().name, *what))

    def lock_held(self) -> bool:
        return self.store_lock is not None and self.store_lock._is_owned()

    def empty(self, nbytes: int) -> torch.Tensor:
        if self.fail_empty:
            raise torch.cuda.OutOfMemoryError("stand-in: out of device memory")
        self.arena = torch.full((nbytes,), GARBAGE, dtype=torch.uint8)
        return self.arena

    def new_stream(self) -> StandInStream:
        stream = StandInStream(self)
        self.side.append(stream)
        return stream

    def new_event(self) -> StandInEvent:
        return StandInEvent(self)

    def current_stream(self) -> StandInStream:
        return self.compute

    def copy_on(self, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        kind = "copy_in" if self._on_device(dst) else "copy_out"
        stream.enqueue(kind, dst, src)
        self.note(kind)

    def _on_device(self, t: torch.Tensor) -> bool:
        base = self.arena.data_ptr()
        return base <= t.data_ptr() < base + self.arena.numel()

    # -- the rules, checked where the store acts on pinned bytes ------------------------------
    def pending_or_unsynced(self, kind: str, ptr: int, nbytes: int, field: str) -> list[_Op]:
        """Ops of ``kind`` whose ``field`` range meets [ptr, ptr+nbytes) that the host has
        not waited for."""
        (stream,) = self.side
        with stream._lock:
            return [op for op in stream.ops[stream.host_synced:] if op.kind == kind
                    and getattr(op, field) < ptr + nbytes and ptr < getattr(op, field) + op.nbytes]


class RuleChecks:
    """Wraps the store's pool release and its arrays' write-backs to check, at the moment
    the store acts, that the host waited for every copy touching those pinned bytes."""

    def __init__(self, store: TieredStore, device: StandInDevice):
        self.device = device
        self.violations: list[str] = []
        self.writes_checked = 0          # write-backs of buffers a copy-out had filled
        self.frees_checked = 0           # buffers freed that a copy-in had read
        device.store_lock = store._lock
        pool_release = store.pool.release

        def release(buf):
            self._check_free(buf)
            pool_release(buf)

        store.pool.release = release
        self._store = store

    def watch(self, name: str) -> None:
        flat = self._store.arrays()[name].flat
        write_from = flat.write_from

        def checked_write(start, stop, src, **kw):
            self._check_write(src)
            return write_from(start, stop, src, **kw)

        flat.write_from = checked_write

    def _copied(self, kind, ptr, nbytes, field) -> bool:
        (stream,) = self.device.side
        with stream._lock:
            return any(op.kind == kind and getattr(op, field) < ptr + nbytes
                       and ptr < getattr(op, field) + op.nbytes for op in stream.ops)

    def _check_write(self, buf) -> None:
        ptr, n = buf.data_ptr(), buf.nbytes
        self.writes_checked += self._copied("copy_out", ptr, n, "dst")
        if self.device.pending_or_unsynced("copy_out", ptr, n, "dst"):
            self.violations.append(f"write-back of {ptr:#x} before the host waited for its copy-out")

    def _check_free(self, buf) -> None:
        ptr, n = buf.data_ptr(), buf.capacity
        self.frees_checked += self._copied("copy_in", ptr, n, "src")
        if self.device.pending_or_unsynced("copy_in", ptr, n, "src"):
            self.violations.append(f"buffer {ptr:#x} freed before the host waited for a copy-in")


def make_store(path, device=None, **over) -> TieredStore:
    cfg = dict(nvme_paths=[str(path)], cpu_budget=4 * B, gpu_budget=2 * B, bucket_bytes=B,
               prefetch_depth=2, io_threads=2, queue_depth=2, acquire_timeout_s=5)
    cfg.update(over)
    return TieredStore(cfg, gpu_device=device if device is not None else StandInDevice())


def cuda_steps(store, name, steps, nb):
    """Each step: every bucket in the store's order acquired on "cuda", +1, released dirty."""
    for _ in range(steps):
        order = store.begin_step() or [(name, i) for i in range(nb)]
        for key in order:
            h = store.acquire(*key, device="cuda")
            h.tensor.add_(1)
            store.release(h, dirty=True)


def read_only_cuda_step(store, name, nb) -> None:
    order = store.begin_step() or [(name, i) for i in range(nb)]
    for key in order:
        h = store.acquire(*key, device="cuda")
        float(h.tensor.sum())
        store.release(h)


def values(store, name, nb) -> list[float]:
    out = []
    for i in range(nb):
        h = store.acquire(name, i)
        t = h.tensor.clone()
        store.release(h)
        assert bool((t == t[0]).all()), f"bucket {i} is torn: {t.unique()}"
        out.append(float(t[0]))
    return out


# -- the rules ----------------------------------------------------------------------------------
def test_cuda_users_bytes_reach_disk_after_their_copies_and_buffers_free_after_theirs(tmp_path):
    """10 buckets through a pool of 4 and a GPU arena of 2, on "cuda", 4 steps: every
    write-back starts after the host waited for its copy-out (on the copy waiter thread,
    off the store lock), every buffer freed after the host waited for the copy-in that
    read it, all copies on one side stream, events reused; what lands on disk is right."""
    dev = StandInDevice()
    with make_store(tmp_path, dev) as s:
        s.register("m", torch.float32, 10 * N)
        checks = RuleChecks(s, dev)
        checks.watch("m")
        cuda_steps(s, "m", 3, 10)
        read_only_cuda_step(s, "m", 10)              # clean buckets are dropped, not written
        cuda_steps(s, "m", 1, 10)
        s.flush()
        assert values(s, "m", 10) == [4.0] * 10
        assert s.stats().bytes_written["nvme"] > 0
        assert s.gpu.events.created <= 16, s.gpu.events.created      # reused, not one per copy
    assert checks.violations == []
    assert checks.writes_checked > 10 and checks.frees_checked > 10  # the rules were exercised
    assert len(dev.side) == 1                                        # one side stream
    waiter_syncs = [held for name, held in dev.syncs if name == "oe-copy-wait"]
    assert waiter_syncs and not any(waiter_syncs)                    # waits off the lock
    assert not any(name.startswith("oe-io") for name, _ in dev.syncs)
    with TieredStore(dict(nvme_paths=[str(tmp_path)], cpu_budget=4 * B, bucket_bytes=B)) as s:
        s.register("m", torch.float32, 10 * N)
        assert values(s, "m", 10) == [4.0] * 10                      # what reached the disk


def test_every_copy_in_waits_for_compute_and_compute_waits_for_it(tmp_path):
    dev = StandInDevice()
    with make_store(tmp_path, dev) as s:
        s.register("m", torch.float32, 6 * N)
        cuda_steps(s, "m", 2, 6)
    log = [e[1:] for e in dev.log if e[0] == threading.current_thread().name]
    copy_ins = [i for i, e in enumerate(log) if e == ("copy_in",)]
    assert len(copy_ins) == 12                           # each bucket staged once per step
    for i in copy_ins:
        assert log[i - 1] == ("side_waits_compute",)     # the extent may still be read
        assert log[i + 1][0] == "record"
        assert log[i + 2] == ("compute_waits", log[i + 1][1])


def test_a_cpu_user_after_a_cuda_user_sees_its_bytes(tmp_path):
    """The copy back to the pinned buffer is still on the side stream when a CPU acquire
    comes: the acquire waits for it."""
    dev = StandInDevice()
    with make_store(tmp_path, dev, cpu_budget=8 * B) as s:
        s.register("m", torch.float32, 3 * N)
        for i in range(3):
            h = s.acquire("m", i, device="cuda")
            h.tensor.fill_(7 + i)
            s.release(h, dirty=True)
        assert dev.side[0].executed < len(dev.side[0].ops)    # copies still pending
        assert values(s, "m", 3) == [7.0, 8.0, 9.0]


def test_a_snapshot_sees_the_bytes_of_copies_still_on_their_way(tmp_path):
    dev = StandInDevice()
    got = {}
    with make_store(tmp_path, dev, cpu_budget=8 * B) as s:
        s.register("m", torch.float32, 4 * N)
        s.register("g", torch.float32, N, home="gpu")
        h = s.acquire("g", 0, device="cuda")
        h.tensor.fill_(5)
        s.release(h, dirty=True)
        cuda_steps(s, "m", 1, 4)
        assert dev.side[0].executed < len(dev.side[0].ops)    # copies still pending
        snap = s.snapshot(lambda name, i, start, t: got.__setitem__((name, i), float(t[0])))
        snap.wait(30)
    assert got == {**{("m", i): 1.0 for i in range(4)}, ("g", 0): 5.0}


def test_gpu_home_buckets_start_as_zeros_and_are_lent_only_on_cuda(tmp_path):
    dev = StandInDevice()
    with make_store(tmp_path, dev) as s:
        s.register("g", torch.float32, N, home="gpu")
        with pytest.raises(InputError, match="lives on the GPU"):
            s.acquire("g", 0)
        h = s.acquire("g", 0, device="cuda")
        assert int(h.tensor.count_nonzero()) == 0             # zeroed, not the arena's garbage
        base = dev.arena.data_ptr()                            # the arena itself, no copy
        assert base <= h.tensor.data_ptr() < base + dev.arena.numel()
        h.tensor.add_(3)
        s.release(h, dirty=True)
        h = s.acquire("g", 0, device="cuda")
        assert float(h.tensor[0]) == 3.0
        s.release(h)
        assert [e for e in dev.log if e[1].startswith("copy")] == []   # never copied
        assert s.stats().zero_fills == 1


def test_a_gpu_home_bucket_placed_where_a_copy_out_is_pending_waits_for_it(tmp_path):
    """A staged bucket's extent is freed as soon as its copy-out is queued; a gpu-home
    bucket first used right after may get that extent. Its zeroing and its user run on the
    compute stream, so the compute stream must wait for the side stream first, or the
    copy-out carries the new bucket's bytes to the staged bucket's pinned buffer."""
    dev = StandInDevice()
    with make_store(tmp_path, dev, cpu_budget=8 * B) as s:
        s.register("m", torch.float32, N)
        s.register("g", torch.float32, N, home="gpu")
        h = s.acquire("m", 0, device="cuda")
        h.tensor.fill_(2)
        s.release(h, dirty=True)                  # copy-out queued, extent freed
        h = s.acquire("g", 0, device="cuda")      # first use: placed, likely in that extent
        assert int(h.tensor.count_nonzero()) == 0
        h.tensor.fill_(9)
        s.release(h, dirty=True)
        assert values(s, "m", 1) == [2.0]


def test_a_full_gpu_tier_refuses_the_acquire_and_lends_nothing(tmp_path):
    with make_store(tmp_path) as s:
        s.register("m", torch.float32, 3 * N)
        held = [s.acquire("m", i, device="cuda") for i in range(2)]
        with pytest.raises(UsageError, match="gpu tier full"):
            s.acquire("m", 2, device="cuda")
        assert s._arrays["m"].buckets[2].refs == 0
        for h in held:
            s.release(h, dirty=True)
        h = s.acquire("m", 2, device="cuda")                   # room again
        s.release(h)


def test_the_stand_in_catches_a_write_back_that_does_not_wait_for_its_copy(tmp_path, monkeypatch):
    """The checks above can fail: a copy waiter that skips the wait is caught, and the
    bytes it writes are the stale ones."""
    def no_wait(self, b, event, write, fail):
        self.events.give(event)
        write(b)

    monkeypatch.setattr(GpuStaging, "_write_after_copy", no_wait)
    dev = StandInDevice()
    with make_store(tmp_path, dev) as s:
        s.register("m", torch.float32, 10 * N)
        checks = RuleChecks(s, dev)
        checks.watch("m")
        cuda_steps(s, "m", 2, 10)
        s.flush()
    assert any("before the host waited for its copy-out" in v for v in checks.violations)


def test_the_stand_in_catches_a_buffer_freed_while_a_copy_in_may_read_it(tmp_path, monkeypatch):
    monkeypatch.setattr(GpuStaging, "settle_copy_in", lambda self, b: None)
    dev = StandInDevice()
    with make_store(tmp_path, dev) as s:
        s.register("m", torch.float32, 10 * N)
        checks = RuleChecks(s, dev)
        cuda_steps(s, "m", 1, 10)
        s.flush()
        read_only_cuda_step(s, "m", 10)
    assert any("freed before the host waited for a copy-in" in v for v in checks.violations)


# -- setup and teardown -------------------------------------------------------------------------
def _store_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("oe-")}


def test_a_failing_gpu_tier_unwinds_everything_opened_before_it(tmp_path):
    before = _store_threads()
    with pytest.raises(torch.cuda.OutOfMemoryError):
        make_store(tmp_path, StandInDevice(fail_empty=True))
    assert _store_threads() == before                # oe-store, oe-io-*, oe-copy-wait ended
    WriteLock(str(tmp_path)).release()               # the write lock was released


def test_close_ends_every_thread_and_releases_the_lock(tmp_path):
    before = _store_threads()
    s = make_store(tmp_path)
    assert {"oe-store", "oe-copy-wait"} <= {t.name for t in _store_threads() - before}
    s.register("m", torch.float32, 4 * N)
    cuda_steps(s, "m", 1, 4)
    s.close()
    assert _store_threads() == before
    WriteLock(str(tmp_path)).release()


def test_without_a_gpu_budget_there_is_no_gpu_tier(tmp_path):
    with make_store(tmp_path, gpu_budget=0) as s:
        assert s.gpu is None
        s.register("m", torch.float32, N)
        with pytest.raises(InputError, match="no gpu tier|CUDA is not available"):
            s.acquire("m", 0, device="cuda")
