"""TieredStore: flat state arrays served bucket by bucket from GPU, pinned CPU or NVMe.

An NVMe-home bucket goes disk --(read, prefetched)--> pinned buffer --(acquire: the view,
or a copy to the GPU)--> user --(release dirty)--> pinned buffer --(write-back when evicted
or flushed)--> disk; what to read ahead and evict is the policy's (store/policy.py). This
module keeps the bucket state machine (absent, reading, resident, writing); its
collaborators: store/registry.py (arrays, manifest), gpu_staging.py, snapshot.py,
io_choice.py, resources.py (what is opened and closed), acquire_wait.py (timeouts).

Threads: one lock guards all bucket state. Callers (acquire, release, flush) take it on
their own threads. I/O completions never do: an I/O thread only posts the completion to the
store's thread, oe-store (store/completions.py), which takes the lock, updates the bucket,
wakes waiters and issues the next prefetches. With CUDA, one more thread (oe-copy-wait)
waits for device->host copies before starting their write-backs, outside the lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import torch

from ..errors import InputError, UsageError
from ..interrupts import InterruptSafeCondition, deferred, wait_in_slices
from .bucket import ABSENT, READING, RESIDENT, WRITING, Bucket, Handle, check_acquire_device
from .completions import failed, interrupted_start, report_unstarted, started
from .config import StoreConfig
from .counters import StatsCounter, StoreStats
from .earlier_run import EarlierRun
from .pool_slots import room_needed, slot_bytes, take_buffer
from .acquire_wait import AcquireWait, in_flight
from .errors import for_bucket
from .policy import Credit, ResidencyPolicy
from .registry import ArrayRegistry, StoreArray, check_new_array
from .resources import open_resources
from .snapshot import Snapshot, SnapshotBuckets, check_can_start, claim_order, wait_out_failed

log = logging.getLogger(__name__)

_KEPT_ERRORS = 16     # write-back errors kept for flush() and acquire() to raise


class TieredStore:
    """Flat arrays of optimizer state across GPU, pinned CPU and NVMe (see docs/store.md).

    Args:
        config: a StoreConfig or a dict validated into one.
        gpu_device: the device operations of the GPU tier (store/gpu_staging.py); default:
            CUDA's when it is available and ``gpu_budget > 0``. Tests pass a CPU stand-in.
    """

    def __init__(self, config: StoreConfig | dict, *, gpu_device=None):
        self.config = cfg = config if isinstance(config, StoreConfig) else StoreConfig.load(config)
        self.root = os.path.abspath(cfg.nvme_paths[0]) if cfg.nvme_paths else None
        self._stripes = [os.path.abspath(p) for p in cfg.nvme_paths]
        self._stats = StatsCounter()
        # everything opened here is undone, in reverse, by one stack: by close(), or at once
        # when a later step fails (store/resources.py says in which order)
        with contextlib.ExitStack() as stack:
            res = open_resources(stack, cfg, self.root, self._stripes, self, self._stats,
                                 gpu_device)
            self._registry = ArrayRegistry(cfg, self.root, self._stripes, res.io,
                                           res.gpu.capacity if res.gpu else None,
                                           res.pool.capacity)
            self._teardown = stack.pop_all()
        self.pool, self.io, self.gpu = res.pool, res.io, res.gpu
        self._locks = res.locks
        self._io_settings = res.io_settings
        self._completions = res.completions  # the store's thread, oe-store
        self._copy_waiter = res.copy_waiter  # GPU tier only: oe-copy-wait
        self._arrays: dict[str, StoreArray] = self._registry.arrays  # the same dict
        # every change of bucket state is made under this lock, and a signal's handler never
        # runs half way through one: it runs when the lock is let go, or in a wait
        self._lock = self._cv = InterruptSafeCondition()
        self._resident: set[Bucket] = set()
        self._prefetch_queue: list[Bucket] = []
        # the step order, read-ahead, victims and write-back credit; the store reports to it
        # every change of a bucket that can make it an eviction candidate or not
        self._policy = ResidencyPolicy(cfg.prefetch_depth, cfg.alternate_order)
        self._write_errors: list[BaseException] = []
        self._tick = 0
        self._snapshot: Snapshot | None = None
        self._closed = False
        self._slot_bytes = slot_bytes(cfg.bucket_bytes, self.pool.capacity)  # pool_slots.py

    # -- arrays -----------------------------------------------------------------------------
    def register(self, name: str, dtype: torch.dtype, numel: int, home: str | None = None) -> StoreArray:
        """Declare a flat array of ``numel`` elements of ``dtype``.

        Nothing is written: buckets never touched read as zeros. An NVMe-home array that
        already exists in the store directory (from an earlier run) is reopened, and must
        have the same dtype and numel. Returns the array's description.
        """
        check_new_array(name, dtype, numel)
        with self._lock:
            return self._registry.add(name, dtype, numel, home)

    def earlier_run(self, names=()) -> EarlierRun | None:
        """What an earlier run left in the store directory (``store/earlier_run.py``), or
        None; meaningful before anything is registered."""
        return self._registry.earlier_run(names)

    def discard_earlier_run(self, earlier: EarlierRun) -> None:
        """Remove what ``earlier`` found (arrays, striped chunks, the layers' tables) before
        any array is registered; the store's write lock keeps live writers safe."""
        with self._lock:
            self._registry.discard_earlier_run(earlier)

    def update_manifest(self, entries: dict) -> None:
        """Merge ``entries`` (JSON-serialisable) into the store's manifest (group attributes,
        docs/format.md), rewritten atomically; the store's own keys cannot be overridden."""
        with self._lock:
            self._registry.update_manifest(entries)

    def bucket_ranges(self, name: str) -> list[tuple[int, int]]:
        """The [start, stop) element ranges of ``name``'s buckets, in order."""
        return [(b.start, b.stop) for b in self._registry.get(name).buckets]

    def arrays(self) -> dict[str, StoreArray]:
        return dict(self._arrays)

    # -- acquire / release -------------------------------------------------------------------
    def acquire(self, name: str, rng: tuple[int, int] | int, device: str | torch.device = "cpu") -> Handle:
        """Lend elements ``rng`` = (start, stop) (or a bucket index) of array ``name``.

        On "cpu" the tensor is a view of the pooled pinned buffer itself (no copy); on a CUDA
        device it is a GPU tensor filled by a side-stream copy the current stream waits for.
        Blocks while I/O it needs is in flight: SlowDiskError after ``io_timeout_s``; and
        while every buffer is held: PoolExhaustedError after ``acquire_timeout_s``.
        """
        dev = torch.device(device)
        b, start, stop = self._registry.locate(name, rng)
        check_acquire_device(dev, name, b.array.home, has_gpu_tier=self.gpu is not None)
        # an error, or a signal's exception at the section's end, gives the hold back
        held = False
        try:
            with deferred:  # one section for the whole call (each lock block would be one)
                with self._lock:
                    self._check_open()
                    self._policy.note_use(b.key)
                    t0 = time.monotonic()
                    waited = self._hold(b)
                    held = True
                with self._lock:
                    # copy-on-acquire: a bucket a snapshot still has to copy is copied before use
                    copy_first = self._snapshot is not None and self._snapshot.before_use(b, self._cv)
                    self._tick += 1
                    b.last_use = self._tick
                    self._pump()
                    if waited:
                        self._stats.current.io_wait_s += time.monotonic() - t0
                if copy_first:
                    self._snapshot.copy(b, inline=True)
                with self._lock:
                    if dev.type == "cpu":
                        if self.gpu is not None:  # bytes from a GPU user landed; none still read
                            self.gpu.before_host_use(b)
                        tensor = b.host_view(b.array.dtype)[start - b.start:stop - b.start]
                    else:  # may fail (the gpu tier full): the bucket is not lent after all
                        tensor = self.gpu.stage(b)[start - b.start:stop - b.start]
                    return Handle(name, start, stop, dev, tensor, b)
        except BaseException as e:
            if held:
                with self._lock:
                    if b.saving == threading.get_ident():  # claimed for a snapshot, not copied
                        self._snapshot.abandon(b, e)
                    self._unhold(b)
            raise

    def keep(self, name: str, index: int) -> Handle:
        """Keep bucket ``index`` of ``name`` resident until the handle is released, lending no
        bytes (``handle.tensor`` is None), so a ``snapshot`` may run meanwhile."""
        h = self.acquire(name, index, device="cpu")
        try:
            with self._lock:
                h._bucket.keeps += 1
                h.tensor, h.keep = None, True
        except BaseException:  # Ctrl-C before the caller has the handle: not lent
            self.release(h)
            raise
        return h

    def release(self, handle: Handle, dirty: bool = False) -> None:
        """End the loan of ``handle``; ``dirty`` says its bytes were changed."""
        b = handle._bucket
        with self._lock:
            if handle._released:
                raise UsageError(f"handle of {handle.array}[{handle.start}:{handle.stop}] released twice")
            if handle.keep and dirty:
                raise InputError(f"handle of {handle.array}[{handle.start}:{handle.stop}] "
                                 "is a keep() handle: it lends no bytes to change")
            # the counts first, with no call between them: Ctrl-C landing in a call below
            # leaves the handle released and the bucket no longer held, never half of it
            handle._released = True
            b.refs -= 1
            b.keeps -= handle.keep
            b.dirty = b.dirty or (dirty and b.array.home == "nvme")
            try:
                if handle.device.type == "cuda":
                    self.gpu.unstage(b, dirty)
            finally:
                self._update_candidate(b)
                self._cv.notify_all()
            self._pump()

    def _update_candidate(self, b: Bucket) -> None:
        """Tell the policy whether ``b`` may be evicted now (after any change of its state)."""
        if b.state == RESIDENT and not b.refs and not b.pinned_home and not b.write_failed:
            self._policy.offer(b.key, b.dirty, b.last_use)
        else:
            self._policy.withdraw(b.key)

    def _hold(self, b: Bucket) -> bool:
        """(Lock held.) One more holder of ``b`` (no victim from now on); brings it in and
        returns whether that waited. Undone on failure."""
        b.refs += 1
        try:
            self._update_candidate(b)
            return self._make_resident(b, demand=True)
        except BaseException:
            self._unhold(b)
            raise

    def _unhold(self, b: Bucket) -> None:
        """(Lock held.) Undo one ``_hold`` of ``b``: it may be a victim again."""
        b.refs -= 1
        self._update_candidate(b)
        self._cv.notify_all()

    def _make_resident(self, b: Bucket, demand: bool) -> bool:
        """Bring ``b`` into its buffer; returns whether the caller had to wait. Waiting on
        I/O in flight and waiting for pinned space have their own bounds (acquire_wait.py)."""
        clock = AcquireWait(b, self.config.acquire_timeout_s, self.config.io_timeout_s)
        counted = retried = False
        while True:
            if b.error is not None:
                err, b.error = b.error, None
                raise err
            if b.state == RESIDENT:
                if not counted:
                    self._stats.current.hits += 1
                return clock.waited
            if b.state == ABSENT:
                status = self._fill(b, demand)
                if status == "started":
                    if not counted:
                        self._stats.current.misses += 1
                        counted = True
                    continue
                if status == "none" and any(r.write_failed for r in self._resident):
                    # no victim but buckets whose write-back failed: write them once more
                    # (the disk may have room again); if that fails too, say why
                    if not retried:
                        self._retry_failed_writes()
                        retried = True
                        continue
                    raise self._write_errors[-1]
            elif b.state == WRITING:
                self._policy.writebacks.keep(b.key)  # needed again: keep it once the write lands
            elif b.state == READING and not counted:
                self._stats.current.hits += 1  # prefetched: the read was already on its way
                counted = True
            clock.wait(self._cv, in_flight(self._resident),
                       sorted((r for r in self._resident if r.refs and r is not b),
                              key=lambda r: r.key), self.pool)

    # -- filling and eviction -----------------------------------------------------------------
    def _fill(self, b: Bucket, demand: bool, credit: Credit | None = None) -> str:
        """Start bringing ``b`` in: "started", "pending" (space is being freed) or "none".

        ``credit``: bytes that write-backs in flight will free and that no earlier fill of
        this prefetch pass has claimed: while it covers ``b``, no further bucket is evicted.
        """
        arr = b.array
        if arr.home == "gpu":
            self.gpu.place(b)
            b.state = RESIDENT
            self._stats.current.zero_fills += 1
            return "started"
        if credit is None:
            credit = self._policy.writebacks.credit()
        buf, status = self._get_buffer(b, demand, credit)
        if buf is None:
            return status
        done = lambda f, b=b: self._completions.post(self._read_done, b, f)  # noqa: E731
        try:  # Ctrl-C anywhere below leaves the buffer given back, or the read reported
            b.buf = buf
            self._resident.add(b)
            if arr.home != "nvme" or not b.on_disk:
                buf.bytes.zero_()  # first touch: zeros, nothing read, nothing written
                b.state = RESIDENT
                self._update_candidate(b)
                self._stats.current.zero_fills += 1
                self._cv.notify_all()
                return "started"
            b.state, b.io_since = READING, time.monotonic()
            started(done, arr.flat.read_into, b.start, b.stop, buf)
        except BaseException as e:
            if b.state == ABSENT:  # before the read was marked: not taken after all
                self._drop(b, count=False)
            elif b.state == READING:  # at the very call of started(): reported here
                report_unstarted(e, done)
            raise
        return "started"

    def _read_done(self, b: Bucket, fut) -> None:
        """A read landed (on the store's thread, oe-store)."""
        with self._lock:
            err = fut.exception()
            if err is not None:
                retry, err = interrupted_start(err), for_bucket("read", b, err)
                if b.refs and not retry:  # an acquire waits for these bytes: it raises the error
                    b.error = err
                else:  # a read ahead nobody waits for: the acquire that needs it reads again
                    log.warning("%s (read again when needed)", err)
                self._drop(b, count=False)
            else:
                b.state = RESIDENT
                self._update_candidate(b)
                self._stats.current.bytes_read["nvme"] += b.nbytes
            self._cv.notify_all()
            self._pump()

    def _get_buffer(self, b: Bucket, demand: bool, credit: Credit):
        """A pinned buffer for ``b`` now, or (None, "pending" | "none"): evicts the victims
        the policy names until one fits; a dirty victim is written back first."""
        while True:
            buf = take_buffer(self.pool, b, self._slot_bytes)
            if buf is not None:
                return buf, "ok"
            if credit.claim(room_needed(b, self._slot_bytes)):
                return None, "pending"  # a write-back in flight will make room: wait for it
            key = self._policy.choose_victim(demand, b.key)
            if key is None:
                return None, ("pending" if self._policy.writebacks.in_flight else "none")
            victim = self._bucket(key)
            if victim.dirty:
                self._start_write(victim, evict_after=True)
                return None, "pending"
            self._drop(victim)

    def _retry_failed_writes(self, evict_after: bool = True) -> None:
        """Start writing again every unheld bucket whose write-back failed (evicted once
        written with ``evict_after``); the outcome reaches ``_write_done`` as any does."""
        for r in [r for r in self._resident
                  if r.write_failed and r.state == RESIDENT and not r.refs]:
            r.write_failed = False
            if r.dirty:
                self._start_write(r, evict_after=evict_after)
            else:
                self._update_candidate(r)

    def _drop(self, b: Bucket, count: bool = True) -> None:
        if self.gpu is not None:  # the pool may hand the buffer to the next read at once
            self.gpu.forget(b)
        if b.buf is not None:
            self.pool.release(b.buf)
            b.buf = None
        self._resident.discard(b)
        b.state = ABSENT
        b.dirty = False
        self._policy.withdraw(b.key)
        if count:
            self._stats.current.evictions += 1

    def _start_write(self, b: Bucket, evict_after: bool) -> None:
        b.state, b.dirty = WRITING, False  # together, before any call: no victim from here
        counted = False
        try:  # Ctrl-C anywhere below: the write-back is counted and its outcome reported
            self._policy.writebacks.start(b.key, b.buf.capacity, evict_after)
            counted = True
            b.io_since = time.monotonic()
            self._policy.withdraw(b.key)
            # bytes still arriving from the GPU: the copy waiter thread waits for them and
            # then starts the write, never under this lock
            if self.gpu is None or not self.gpu.write_when_copied(b, self._write,
                                                                  self._write_failed):
                self._write(b)
        except BaseException as e:
            if not counted:
                self._policy.writebacks.start(b.key, b.buf.capacity, evict_after)
            self._policy.withdraw(b.key)
            report_unstarted(e, lambda f, b=b: self._completions.post(self._write_done, b, f))
            raise

    def _write_failed(self, b: Bucket, error: BaseException) -> None:
        """A write-back that failed before its I/O started ends like an I/O error."""
        self._completions.post(self._write_done, b, failed(error))

    def _write(self, b: Bucket) -> None:
        """Start writing ``b``'s buffer home; its outcome reaches ``_write_done`` on oe-store."""
        started(lambda f, b=b: self._completions.post(self._write_done, b, f),
                b.array.flat.write_from, b.start, b.stop, b.buf)

    def _write_done(self, b: Bucket, fut) -> None:
        """A write-back landed or failed (on the store's thread, oe-store)."""
        with self._lock:
            evict = self._policy.writebacks.finish(b.key) and b.refs == 0
            err = fut.exception()
            if interrupted_start(err):  # Ctrl-C cut its start short: again, here on oe-store
                return self._start_write(b, evict)
            if err is not None:
                err = for_bucket("write-back", b, err)
                log.error("%s", err)
                b.dirty = True  # the bytes are still here: nothing is lost
                b.write_failed = True  # not a victim until written (flush, or a retry)
                b.state = RESIDENT
                self._write_errors = self._write_errors[-(_KEPT_ERRORS - 1):] + [err]
            else:
                b.on_disk = True
                self._stats.current.bytes_written["nvme"] += b.nbytes
                if evict:
                    self._drop(b)
                else:
                    b.state = RESIDENT
            self._update_candidate(b)
            self._cv.notify_all()
            self._pump()

    def _pump(self) -> None:
        """Issue reads for the next ``prefetch_depth`` scheduled buckets and queued prefetches."""
        if self._closed:
            return
        wanted = [self._bucket(k) for k in self._policy.upcoming()]
        if self._prefetch_queue:
            self._prefetch_queue = [q for q in self._prefetch_queue if q.state == ABSENT]
            wanted += self._prefetch_queue
        credit = self._policy.writebacks.credit()
        for b in dict.fromkeys(wanted):  # once each: the next step may start where this ends
            if b.state != ABSENT or b.array.home == "gpu":
                continue
            if self._fill(b, demand=False, credit=credit) == "none":
                break

    def _bucket(self, key) -> Bucket:
        return self._arrays[key[0]].buckets[key[1]]

    # -- schedule ------------------------------------------------------------------------------
    def set_schedule(self, forward: list[tuple[str, int]] | None,
                     backward: list[tuple[str, int]] | None = None) -> None:
        """Declare the per-step bucket orders once: ``forward`` and ``backward`` list
        ``(array, bucket_index)`` pairs (default backward: forward reversed); None clears
        them. docs/store.md, API, says how the store walks them."""
        with self._lock:
            if forward is None:
                self._policy.clear()
                return
            forward, backward = [tuple(k) for k in forward], backward and [tuple(k) for k in backward]
            self._registry.check_keys(forward + (backward or []))
            self._policy.declare(forward, backward)

    def begin_step(self) -> list[tuple[str, int]] | None:
        """Mark a step boundary; returns this step's bucket order (the declared one, alternating
        with ``alternate_order``), or None while the first step's acquire order is recorded."""
        with self._lock:
            # write-backs that failed (a full disk) are tried again once per step, so their
            # bytes reach the disk as soon as it has room, with no flush() needed
            self._retry_failed_writes(evict_after=False)
            self._io_settings.adapt()
            order = self._policy.begin_step()
            if order is None:
                return None
            self._pump()
            return list(order)

    def set_io_settings(self, op: str, settings) -> None:
        """Use ``settings`` (io.settings.DirectionSettings) for ``op`` ("read" or "write")
        from now on; bytes already written read back the same in every mode."""
        self._io_settings.set(op, settings)

    def io_settings(self) -> dict:
        """The I/O settings in force per direction and where they came from
        (``io_choice.IOSettings.report`` lists the keys)."""
        return self._io_settings.report()

    @property
    def step_is_backward(self) -> bool:
        """Whether the step begun last walks the backward order (False while recording)."""
        with self._lock:
            return self._policy.step_is_backward

    @property
    def writes_in_flight(self) -> int:
        """Write-backs started and not yet landed (write-behind of buckets evicted or flushed)."""
        with self._lock:
            return self._policy.writebacks.in_flight

    def prefetch(self, ranges) -> None:
        """Start reading the buckets holding ``ranges``: (array, (start, stop)) or (array, index)."""
        with self._lock:
            self._check_open()
            for name, rng in ranges:
                b, _, _ = self._registry.locate(name, rng)
                if b.state == ABSENT and b not in self._prefetch_queue:
                    self._prefetch_queue.append(b)
            self._pump()

    # -- snapshots -----------------------------------------------------------------------------
    def snapshot(self, sink, arrays: list[str] | None = None) -> Snapshot:
        """Copy ``arrays`` (default: all) as they are now, in the background: ``sink(array,
        bucket_index, start_element, tensor)`` once per bucket, from a background thread or
        an ``acquire`` that needs the bucket first (store/snapshot.py). One at a time."""
        with self._lock:
            self._check_open()
            wait_out_failed(self._snapshot, self._cv, self.config.io_timeout_s)
            check_can_start(self._snapshot, sorted(b.key for b in self._resident if b.refs > b.keeps))
            names = list(self._arrays) if arrays is None else arrays
            sched = self._policy.schedule
            scheduled = [self._bucket(k) for k in sched.order_for(sched.step + 1)] if sched else []
            wanted = [b for n in names for b in self._registry.get(n).buckets]
            bytes_of = (self.gpu.bytes_now if self.gpu is not None  # else: the pinned bytes
                        else lambda b: b.host_view(b.array.dtype))
            access = SnapshotBuckets(self._cv, self._hold, bytes_of, self._let_go_after_snapshot)
            self._snapshot = snap = Snapshot(claim_order(scheduled, wanted), sink, access)
            snap.start()
            return snap

    def _let_go_after_snapshot(self, b: Bucket, held: bool) -> None:
        with self._lock:
            b.saving = False
            if held:
                self._unhold(b)
                self._pump()
            self._cv.notify_all()

    # -- flush / stats / close --------------------------------------------------------------------
    def flush(self, sync: bool = False) -> None:
        """Write every dirty NVMe bucket home and wait; with ``sync`` also fdatasync them.

        Raises the first write error (a FileIOError naming the chunk file); the bytes stay
        in memory, dirty, so a later flush can retry.
        """
        with self._lock:
            self._check_open()
            t0 = time.monotonic()
            self._write_errors.clear()
            for b in list(self._resident):
                b.write_failed = False
                if b.dirty and b.state == RESIDENT:
                    self._start_write(b, evict_after=False)
                else:
                    self._update_candidate(b)
            while self._policy.writebacks.in_flight:
                self._cv.wait()
            self._stats.current.io_wait_s += time.monotonic() - t0
            if self._write_errors:
                raise self._write_errors[0]
            written = [b for a in self._arrays.values() if a.home == "nvme" for b in a.buckets if b.on_disk]
        if sync:
            futures = [self.io.sync(b.array.flat.chunk_path(b.index)) for b in written]
            for f in futures:
                f.result()

    def stats(self, reset: bool = False) -> StoreStats:
        """Counters since the last reset (see StoreStats); ``reset`` starts new ones."""
        with self._lock:
            snap = self._stats.snapshot(self.pool.peak_in_use,
                                        self.gpu.peak_in_use if self.gpu else 0)
            snap.io = self.io_settings()
            if reset:
                self._stats.reset()
                self.pool.reset_peak()
            return snap

    def resident_buckets(self) -> list[tuple[str, int]]:
        """Keys of buckets whose bytes are in the pinned pool now."""
        with self._lock:
            return sorted(b.key for b in self._resident if b.state in (RESIDENT, WRITING))

    def close(self) -> None:
        """Flush dirty buckets, stop I/O, free the pool and release the write lock."""
        if self._closed:
            return
        if self._snapshot is not None:
            wait_in_slices(self._snapshot.finished.wait)
        try:
            if self.root is not None:
                self.flush()
        finally:
            with self._lock:
                self._closed = True
            # in reverse order of setup: after the flush no write-back waits for a copy, so
            # the copy waiter ends; then every I/O ends (and posts its completion); then
            # the store's thread handles what was posted and ends; then the pool and locks
            self._teardown.close()

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("the store is closed")

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

