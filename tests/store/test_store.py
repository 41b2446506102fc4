import errno
import gc
import multiprocessing as mp
import os
import tempfile
import threading

import numpy as np
import psutil
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload_engine.io import FileIOError, IOFuture, PoolExhaustedError
from offload_engine.layout import FlatArray
from offload_engine.store import StoreConfig, StoreLockedError, TieredStore

from helpers.store_runs import B, make_store, run_steps


# -- config ------------------------------------------------------------------------------------
def test_config_rejects_unknown_keys_by_name():
    with pytest.raises(ValueError, match="cpu_budgte"):
        StoreConfig.model_validate({"nvme_paths": ["/x"], "cpu_budgte": "8GiB"})


def test_config_sizes_accept_strings():
    cfg = StoreConfig(nvme_paths=["/x"], cpu_budget="8GiB", gpu_budget="5GB", bucket_bytes="64MiB")
    assert cfg.cpu_budget == 8 << 30 and cfg.gpu_budget == 5 * 10**9 and cfg.bucket_bytes == 64 << 20
    with pytest.raises(ValueError, match="multiple of 4096"):
        StoreConfig(nvme_paths=["/x"], bucket_bytes=1000)
    with pytest.raises(ValueError, match="not a size"):
        StoreConfig(nvme_paths=["/x"], cpu_budget="lots")
    with pytest.raises(ValueError, match="nvme_paths is empty"):
        StoreConfig(default_home="nvme")


def test_config_from_file_names_the_file(tmp_path):
    p = tmp_path / "store.json"
    p.write_text('{"nvme_paths": ["/x"], "prefetch_dept": 3}')
    with pytest.raises(ValueError, match=f"{p}.*prefetch_dept"):
        StoreConfig.from_file(str(p))


# -- basic semantics ----------------------------------------------------------------------------
def test_lazy_init_writes_nothing_and_reads_zeros(tmp_path):
    with make_store(tmp_path) as s:
        s.register("m", torch.float32, 1_000_000)
        assert os.listdir(tmp_path / "m" / "c") == []
        h = s.acquire("m", 3)
        assert h.tensor.numel() == B // 4 and int(h.tensor.abs().sum()) == 0
        s.release(h)
        st_ = s.stats()
        assert st_.zero_fills == 1 and st_.bytes_read["nvme"] == 0
    assert os.listdir(tmp_path / "m" / "c") == []  # clean zeros are never written


def test_cpu_acquire_returns_the_pooled_buffer_itself(tmp_path):
    with make_store(tmp_path) as s:
        s.register("m", torch.float32, 10_000)
        h = s.acquire("m", (1024, 1100))
        arena = s.pool._arena
        assert arena.data_ptr() <= h.tensor.data_ptr() < arena.data_ptr() + s.pool.capacity
        assert h.tensor.numel() == 76
        s.release(h)


def test_cuda_request_without_cuda_is_a_clear_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with make_store(tmp_path) as s:
        s.register("m", torch.float32, 10_000)
        with pytest.raises(ValueError, match="CUDA is not available"):
            s.acquire("m", 0, device="cuda")
        with pytest.raises(ValueError, match="needs CUDA"):
            s.register("g", torch.float32, 10, home="gpu")


def test_range_errors_are_clear(tmp_path):
    with make_store(tmp_path) as s:
        s.register("m", torch.float32, 10_000)
        with pytest.raises(ValueError, match="crosses a bucket boundary"):
            s.acquire("m", (1000, 1100))
        with pytest.raises(IndexError, match="outside array m"):
            s.acquire("m", (0, 10_001))
        with pytest.raises(KeyError, match="no array named 'x'"):
            s.acquire("x", 0)


def written_and_evicted(s, name):
    """One step over all 10 buckets, flushed, then buckets 0-4 pushed out of the pool."""
    run_steps(s, name, 1)
    s.flush()
    for i in range(5, 10):
        s.release(s.acquire(name, i))
    s.stats(reset=True)


def test_two_acquires_of_one_bucket_share_one_read(tmp_path):
    with make_store(tmp_path) as s:
        s.register("m", torch.float32, 10 * B // 4)
        written_and_evicted(s, "m")
        a = s.acquire("m", 0)
        b = s.acquire("m", 0)
        assert a.tensor.data_ptr() == b.tensor.data_ptr()
        s.release(a)
        s.release(b)
        assert s.stats().bytes_read["nvme"] == B


def test_prefetch_then_acquire_is_a_hit(tmp_path):
    with make_store(tmp_path) as s:
        s.register("m", torch.float32, 10 * B // 4)
        written_and_evicted(s, "m")
        s.prefetch([("m", 0), ("m", (B // 4, B // 4 + 5))])
        for i in (0, 1):
            s.release(s.acquire("m", i))
        st_ = s.stats()
        assert st_.hits == 2 and st_.misses == 0 and st_.bytes_read["nvme"] == 2 * B


def test_data_persists_across_reopen_and_arrays_are_zarr_readable(tmp_path):
    import zarr

    with make_store(tmp_path) as s:
        s.register("m", torch.float32, 7 * B // 4 + 3)
        run_steps(s, "m", 3)
    z = zarr.open_array(str(tmp_path / "m"), mode="r")
    assert np.array_equal(np.asarray(z[:]), np.full(7 * B // 4 + 3, 3, np.float32))
    with make_store(tmp_path) as s:
        s.register("m", torch.float32, 7 * B // 4 + 3)
        h = s.acquire("m", 7)
        assert h.tensor.tolist() == [3.0, 3.0, 3.0]
        s.release(h)
    with pytest.raises(ValueError, match="has dtype torch.float32, 7171 elements"):
        with make_store(tmp_path) as s:
            s.register("m", torch.float32, 100)


def test_striping_round_robin_over_paths_stays_readable(tmp_path):
    import zarr

    a, b = tmp_path / "a", tmp_path / "b"
    with make_store(a, nvme_paths=[str(a), str(b)]) as s:
        s.register("m", torch.int32, 6 * B // 4)
        run_steps(s, "m", 2)
    striped = sorted(os.listdir(b / "stripes" / "m" / "c"))
    assert striped == ["1", "3", "5"]
    assert sorted(os.listdir(a / "m" / "c")) == [str(i) for i in range(6)]
    assert np.array_equal(np.asarray(zarr.open_array(str(a / "m"), mode="r")[:]),
                          np.full(6 * B // 4, 2, np.int32))


# -- bytes moved per step ------------------------------------------------------------------------
@pytest.mark.parametrize("alternate", [True, False])
def test_each_bucket_not_resident_is_read_once_and_written_once_per_step(tmp_path, alternate):
    n, cap = 16, 6
    with make_store(tmp_path, cpu_budget=cap * B, alternate_order=alternate) as s:
        s.register("m", torch.float32, n * B // 4)
        events = []  # ("read"|"write"|"use", bucket index) in the order they happened
        real_read, real_write, real_acquire = s.io.read, s.io.write, s.acquire
        s.io.read = lambda path, *a, **k: (events.append(("read", path)), real_read(path, *a, **k))[1]
        s.io.write = lambda path, *a, **k: (events.append(("write", path)), real_write(path, *a, **k))[1]
        s.acquire = lambda name, i: (real_acquire(name, i),
                                     events.append(("use", s._arrays[name].flat.chunk_path(i))))[0]
        run_steps(s, "m", 1)
        s.flush()
        events.clear()
        s.stats(reset=True)
        total_read = total_written = 0
        for step in range(8):
            start = len(events)
            resident_at_start = len(s.resident_buckets())
            st_ = run_steps(s, "m", 1)[0]
            total_read += st_.bytes_read["nvme"]
            total_written += st_.bytes_written["nvme"]
            reads = [p for e, p in events[start:] if e == "read"]
            writes = [p for e, p in events[start:] if e == "write"]
            assert st_.hits + st_.misses == n  # (which are hits depends on timing)
            if alternate:
                # the whole pool carries over: exactly the other buckets are read and written
                assert resident_at_start == cap
                assert len(reads) == len(set(reads)) == n - cap
                assert len(writes) == len(set(writes)) == n - cap
        s.flush()
        # the counters agree with the I/O issued over the run, once all of it has landed
        reads_after_first = sum(1 for e, _ in events if e == "read")
        writes_after_first = sum(1 for e, _ in events if e == "write")
        assert total_read + s.stats().bytes_read["nvme"] == reads_after_first * B
        assert total_written + s.stats().bytes_written["nvme"] == writes_after_first * B
        # whatever the order: between two reads (or two writes) of a bucket it was used:
        # no read is wasted on a bucket evicted before use, no clean bucket is rewritten
        last = {}
        for kind, path in events:
            if kind in ("read", "write"):
                assert last.get((kind, path)) != "pending", f"{path} {kind} twice without a use"
                last[(kind, path)] = "pending"
            else:
                last[("read", path)] = last[("write", path)] = "used"
        h = s.acquire("m", 0)
        assert float(h.tensor[0]) == 9.0
        s.release(h)


# -- failures ---------------------------------------------------------------------------------
def test_pool_exhaustion_is_a_clear_error_not_a_hang(tmp_path):
    with make_store(tmp_path, cpu_budget=2 * B, acquire_timeout_s=0.3) as s:
        s.register("m", torch.float32, 4 * B // 4)
        held = [s.acquire("m", 0), s.acquire("m", 1)]
        with pytest.raises(PoolExhaustedError, match="2 buckets held by acquire"):
            s.acquire("m", 2)
        for h in held:
            s.release(h)
        s.release(s.acquire("m", 2))


def _second_writer(path, q):
    try:
        TieredStore(dict(nvme_paths=[path], cpu_budget=B, bucket_bytes=B))
        q.put("opened")
    except StoreLockedError as e:
        q.put(str(e))


@pytest.mark.multiprocess
def test_second_writer_is_refused_and_readers_are_not(tmp_path):
    with make_store(tmp_path) as s:
        s.register("m", torch.float32, 4 * B // 4)
        run_steps(s, "m", 1)
        s.flush()
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_second_writer, args=(str(tmp_path), q))
        p.start()
        msg = q.get(timeout=60)
        p.join()
        assert f"open for writing by process {os.getpid()}" in msg and str(tmp_path) in msg
        with pytest.raises(StoreLockedError):
            make_store(tmp_path)  # a second writer in the same process too
        from offload_engine.io import AsyncFileIO
        with AsyncFileIO(threads=1, queue_depth=1) as io:
            reader = FlatArray.open(str(tmp_path / "m"), io=io, mode="r")
            assert bool((reader.read() == 1).all())
    make_store(tmp_path).close()  # released on close


def test_failed_write_back_loses_nothing(tmp_path, monkeypatch):
    with make_store(tmp_path) as s:
        s.register("m", torch.float32, 3 * B // 4)
        run_steps(s, "m", 1)
        real_write = s.io.write

        def full_disk(path, offset, buf, length=None, sync=False):
            f = IOFuture()
            f.set_running_or_notify_cancel()
            f.set_exception(FileIOError(errno.ENOSPC, "write", path, offset, len(memoryview(buf))))
            return f

        monkeypatch.setattr(s.io, "write", full_disk)
        with pytest.raises(FileIOError, match="No space left"):
            s.flush()
        monkeypatch.setattr(s.io, "write", real_write)
        s.flush()  # the bytes were kept: retry succeeds
    with make_store(tmp_path) as s:
        s.register("m", torch.float32, 3 * B // 4)
        for i in range(3):
            h = s.acquire("m", i)
            assert bool((h.tensor == 1).all())
            s.release(h)


def test_a_write_back_that_cannot_start_fails_flush_and_close_without_a_hang(tmp_path, monkeypatch):
    """Creating a chunk file can fail before any I/O is queued (a full disk at fallocate):
    the bucket keeps its bytes, flush raises, and close still ends (threads, lock)."""
    s = make_store(tmp_path)
    s.register("m", torch.float32, 3 * B // 4)
    run_steps(s, "m", 1)                      # three dirty buckets, no chunk file yet

    def no_space(path, nbytes):
        raise FileIOError(errno.ENOSPC, "fallocate", path, 0, nbytes)

    monkeypatch.setattr(s.io, "preallocate", no_space)
    with pytest.raises(FileIOError, match="No space left"):
        s.flush()
    h = s.acquire("m", 0)                     # nothing lost
    assert bool((h.tensor == 1).all())
    s.release(h)
    with pytest.raises(FileIOError, match="No space left"):
        s.close()                             # its flush fails again; it closes anyway
    assert not s._completions.running
    make_store(tmp_path).close()              # the write lock was released


# -- threads ------------------------------------------------------------------------------------
class RecordingLock:
    """An RLock that notes the name of every thread that takes it."""

    def __init__(self):
        self._lock = threading.RLock()
        self.takers: set[str] = set()

    def acquire(self, blocking=True, timeout=-1):
        self.takers.add(threading.current_thread().name)
        return self._lock.acquire(blocking, timeout)

    def release(self):
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()

    # threading.Condition uses these when the lock has them (wait() releases an RLock fully)
    def _release_save(self):
        return self._lock._release_save()

    def _acquire_restore(self, state):
        self.takers.add(threading.current_thread().name)
        self._lock._acquire_restore(state)

    def _is_owned(self):
        return self._lock._is_owned()


def test_io_completions_are_handled_on_the_store_thread_never_under_the_lock_on_io_threads(tmp_path):
    with make_store(tmp_path, cpu_budget=4 * B) as s:
        lock = RecordingLock()
        s._lock, s._cv = lock, threading.Condition(lock)
        s.register("m", torch.float32, 10 * B // 4)
        handled = []
        for name in ("_read_done", "_write_done"):
            def record(b, fut, _real=getattr(s, name), _name=name):
                handled.append((_name, threading.current_thread().name))
                _real(b, fut)
            setattr(s, name, record)
        stats = run_steps(s, "m", 4)              # 10 buckets through a pool of 4
        s.flush()
        assert sum(st_.bytes_read["nvme"] for st_ in stats) > 0
    assert {kind for kind, _ in handled} == {"_read_done", "_write_done"}
    assert {thread for _, thread in handled} == {"oe-store"}
    assert "oe-store" in lock.takers
    io_takers = sorted(t for t in lock.takers if t.startswith("oe-io"))
    assert io_takers == [], f"I/O threads took the store lock: {io_takers}"


def test_chunk_accesses_trust_the_stores_record_instead_of_stat(tmp_path, monkeypatch):
    """The store knows which chunk files exist: reading and writing buckets never stats them."""
    with make_store(tmp_path, cpu_budget=4 * B) as s:
        s.register("m", torch.float32, 10 * B // 4)
        run_steps(s, "m", 2)
        s.flush()                                 # every chunk file exists now
        chunks = str(tmp_path / "m" / "c")
        stats, real_stat = [], os.stat

        def counting_stat(path, *a, **k):
            if os.fspath(path).startswith(chunks):
                stats.append(path)
            return real_stat(path, *a, **k)

        monkeypatch.setattr(os, "stat", counting_stat)
        steps = run_steps(s, "m", 3)
        s.flush()
        monkeypatch.undo()
        assert sum(st_.bytes_read["nvme"] for st_ in steps) > 0
        assert stats == []


def test_a_store_dropped_without_close_lets_its_thread_end(tmp_path):
    s = make_store(tmp_path, cpu_budget=4 * B)
    s.register("m", torch.float32, 10 * B // 4)
    run_steps(s, "m", 2)
    s.flush()
    thread = s._completions._thread
    locks, s._locks = s._locks, []            # (released below: the kernel would, at exit)
    assert thread.is_alive()
    del s
    gc.collect()
    thread.join(10)
    assert not thread.is_alive(), "a dropped store's oe-store thread is still waiting"
    for lock in locks:
        lock.release()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (never run in CI)")
def test_cuda_write_backs_wait_on_one_thread_with_reused_events(tmp_path):
    with make_store(tmp_path, cpu_budget=4 * B, gpu_budget=4 * B) as s:
        s.register("m", torch.float32, 10 * B // 4)
        threads_before = threading.active_count()
        for _ in range(4):                        # 80 copies between host and device
            order = s.begin_step() or [("m", i) for i in range(10)]
            for key in order:
                h = s.acquire(*key, device="cuda")
                h.tensor.add_(1)
                s.release(h, dirty=True)
            assert threading.active_count() == threads_before  # no thread per write-back
        s.flush()
        assert "oe-copy-wait" in {t.name for t in threading.enumerate()}
        assert s.gpu.events.created <= 16, s.gpu.events.created  # not one per copy
        h = s.acquire("m", 9)                     # a CPU user after GPU ones: bytes landed
        assert float(h.tensor[0]) == 4.0
        s.release(h)
        waiter = s._copy_waiter
    assert not waiter.running


# -- resources stay flat -------------------------------------------------------------------------
def test_rss_fds_and_pool_stay_flat_over_500_steps(tmp_path):
    proc = psutil.Process()
    with make_store(tmp_path, cpu_budget=4 * B) as s:
        s.register("m", torch.float32, 8 * B // 4)
        s.register("v", torch.bfloat16, 3 * B // 2, home="cpu")

        def step():
            order = s.begin_step() or [("m", i) for i in range(8)]
            for key in order:
                h = s.acquire(*key)
                h.tensor.add_(1)
                s.release(h, dirty=True)
            hv = s.acquire("v", 0)
            s.release(hv, dirty=True)
            s.stats(reset=True)

        for _ in range(50):
            step()
        gc.collect()
        rss0, fds0, pool0 = proc.memory_info().rss, proc.num_fds(), s.pool.in_use
        for _ in range(450):
            step()
        gc.collect()
        rss1, fds1, pool1 = proc.memory_info().rss, proc.num_fds(), s.pool.in_use
        assert fds1 == fds0
        assert pool1 == pool0
        assert rss1 - rss0 < 8 << 20, f"RSS grew by {(rss1 - rss0) >> 10} KiB"
        h = s.acquire("m", 0)
        assert float(h.tensor[0]) == 500.0
        s.release(h)


# -- property-based integrity -----------------------------------------------------------------------
ARRAYS = {"a": (torch.float32, 5 * B // 4 + 7, "nvme"), "b": (torch.int64, 3 * B // 8, "nvme"),
          "c": (torch.bfloat16, B, "cpu")}

op = st.one_of(
    st.tuples(st.just("acquire"), st.sampled_from(sorted(ARRAYS)), st.integers(0, 10),
              st.booleans(), st.integers(0, 2**31)),
    st.tuples(st.just("release"), st.integers(0, 3), st.booleans()),
    st.tuples(st.just("prefetch"), st.sampled_from(sorted(ARRAYS)), st.integers(0, 10)),
    st.tuples(st.just("step")),
    st.tuples(st.just("flush")),
)


# (read mode, write mode[, streams]) per store; "switching" changes modes, queue depths and
# streams at every step, as the adaptive controller may (io/adaptive.py): the bytes must not care
IO_MODES = {"direct": ("direct", "direct"), "buffered": ("buffered", "buffered"),
            "buffered-reads": ("buffered", "direct"), "buffered-writes": ("direct", "buffered"),
            "switching": ("direct", "buffered"), "streams": ("direct", "buffered", 3)}


def _switch_modes(s) -> None:
    from offload_engine.io.settings import DirectionSettings

    for op in ("read", "write"):
        now = s.io.settings(op)
        flip = "buffered" if now.mode == "direct" else "direct"
        s.set_io_settings(op, DirectionSettings(flip, 1 + now.queue_depth % 3,
                                                now.block_bytes, "adaptive", 1 + now.streams % 3))


@pytest.mark.parametrize("io_mode", sorted(IO_MODES))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=60), budget=st.integers(4, 7), depth=st.integers(0, 3))
def test_random_operations_match_an_in_memory_model(io_mode, ops, budget, depth):
    read_mode, write_mode, *streams = IO_MODES[io_mode]
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as d:
        s = make_store(d, cpu_budget=budget * B, prefetch_depth=depth, acquire_timeout_s=5,
                       read_mode=read_mode, write_mode=write_mode,
                       **({"io_streams": streams[0]} if streams else {}))
        assert s.io.settings("read").mode == read_mode
        assert s.io.settings("write").streams == (streams[0] if streams else 1)
        model = {}
        for name, (dtype, numel, home) in ARRAYS.items():
            s.register(name, dtype, numel, home=home)
            model[name] = torch.zeros(numel, dtype=dtype)
        held = []  # (handle, new values or None)
        # cpu-homed buckets stay in the pool once touched: an acquire that would need more
        # than the budget is the store's PoolExhaustedError to give, not a model mismatch
        pinned_home = sum(len(s.bucket_ranges(n)) for n, a in ARRAYS.items() if a[2] == "cpu")
        for o in ops:
            others = {id(h._bucket) for h, _ in held if ARRAYS[h.array][2] != "cpu"}
            if o[0] == "acquire" and len(held) < 3 and len(others) + pinned_home + 1 <= budget:
                _, name, idx, write, seed = o
                ranges = s.bucket_ranges(name)
                lo, hi = ranges[idx % len(ranges)]
                h = s.acquire(name, (lo, hi))
                assert torch.equal(h.tensor, model[name][lo:hi]), f"{name}[{lo}:{hi}] wrong"
                new = None
                if write and not any(x[0]._bucket is h._bucket and x[1] is not None for x in held):
                    g = torch.Generator().manual_seed(seed)
                    new = torch.randint(-100, 100, (hi - lo,), generator=g).to(h.tensor.dtype)
                    h.tensor.copy_(new)
                    model[name][lo:hi] = new  # other holders of this bucket share the view
                held.append((h, new))
            elif o[0] == "release" and held:
                h, new = held.pop(o[1] % len(held))
                s.release(h, dirty=new is not None)
            elif o[0] == "prefetch":
                ranges = s.bucket_ranges(o[1])
                s.prefetch([(o[1], o[2] % len(ranges))])
            elif o[0] == "step" and not held:
                if io_mode == "switching":
                    _switch_modes(s)
                s.begin_step()
            elif o[0] == "flush":
                s.flush()
        for h, new in held:
            s.release(h, dirty=new is not None)
        s.close()
        s = make_store(d, read_mode=write_mode, write_mode=read_mode)  # the other way round
        for name, (dtype, numel, home) in ARRAYS.items():
            s.register(name, dtype, numel, home=home)
            if home != "nvme":
                continue
            for i in range(len(s.bucket_ranges(name))):
                h = s.acquire(name, i)
                assert torch.equal(h.tensor, model[name][h.start:h.stop]), f"{name} bucket {i} after reopen"
                s.release(h)
        s.close()


def test_manifest_lists_arrays_and_keeps_optimizer_entries(tmp_path):
    from offload_engine.layout import read_group

    with make_store(tmp_path) as s:
        s.register("rank0/m", torch.float32, 3000)
        s.update_manifest({"world_size": 2, "tensors": {"w": {"shape": [2, 3]}}})
        with pytest.raises(ValueError, match="belong to the store"):
            s.update_manifest({"arrays": {}})
    attrs = read_group(str(tmp_path))
    assert attrs["format"] == "offload-engine-store"
    assert attrs["arrays"]["rank0/m"]["numel"] == 3000 and attrs["world_size"] == 2
    with make_store(tmp_path) as s:  # reopening keeps the optimizer's entries
        s.register("rank0/m2", torch.float32, 10)
    assert read_group(str(tmp_path))["tensors"] == {"w": {"shape": [2, 3]}}
