"""TieredStore: flat state arrays served bucket by bucket from GPU, pinned CPU or NVMe.

Data flow for an NVMe-home bucket: disk --(read, prefetched k ahead)--> pinned buffer
--(acquire: the view itself on CPU, or a side-stream copy to the GPU)--> user --(release
dirty)--> pinned buffer --(write-back when evicted or flushed)--> disk. What to read ahead
and what to evict is the residency policy's (store/policy.py: next use in the step order the
store owns), so each bucket not kept resident is read once and written once per step, and
buckets still cached from the previous step are hits. This module keeps the bucket state
machine (absent, reading, resident, writing), the pinned pool and the I/O.

Threads: one lock guards all bucket state. Callers (acquire, release, flush) take it on
their own threads. I/O completions never do: an I/O thread only posts the completion to the
store's thread, oe-store (store/completions.py), which takes the lock, updates the bucket,
wakes waiters and issues the next prefetches. With CUDA, one more thread (oe-copy-wait)
waits for device->host copies before starting their write-backs, outside the lock.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from ..io import AsyncFileIO, BufferPool, FileIOError, IOFuture, PoolExhaustedError, syscalls
from ..io.settings import FIELDS
from .. import dtypes
from ..layout import FlatArray
from ..layout.store_group import STORE_KEYS, open_store_group, store_array_entry, write_store_group
from ..layout.striping import stripe_chunks
from . import geometry
from .bucket import ABSENT, READING, RESIDENT, WRITING, Bucket
from .completions import CompletionQueue
from . import io_choice
from .config import StoreConfig
from .earlier_run import EarlierRun, find_earlier_run, remove_earlier_arrays
from .errors import for_bucket
from .lock import WriteLock
from .policy import Credit, ResidencyPolicy
from .snapshot import Snapshot
from .counters import StatsCounter, StoreStats
from ..errors import InputError, UsageError

log = logging.getLogger(__name__)

_THREAD_JOIN_S = 60  # seconds close() waits for each of the store's threads to end
_KEPT_ERRORS = 16     # write-back errors kept for flush() and acquire() to raise
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")


@dataclass(eq=False)
class _Array:
    name: str
    dtype: torch.dtype
    numel: int
    itemsize: int
    home: str
    bucket_elems: int
    buckets: list
    flat: FlatArray | None = None


@dataclass(eq=False)
class Handle:
    """A bucket range lent to a user: ``tensor`` is valid until ``store.release(handle)``."""

    array: str
    start: int            # first element (array coordinates)
    stop: int
    device: torch.device
    tensor: torch.Tensor | None   # None for a keep() handle: it lends residency, no bytes
    _bucket: Bucket
    _released: bool = False
    keep: bool = False


class TieredStore:
    """Flat arrays of optimizer state across GPU, pinned CPU and NVMe (see docs/store.md).

    Args:
        config: a StoreConfig or a dict validated into one.
    """

    def __init__(self, config: StoreConfig | dict):
        self.config = config if isinstance(config, StoreConfig) else StoreConfig.load(config)
        cfg = self.config
        self.root = os.path.abspath(cfg.nvme_paths[0]) if cfg.nvme_paths else None
        self._stripes = [os.path.abspath(p) for p in cfg.nvme_paths]
        self._locks = []
        for d in self._stripes:
            try:
                try:
                    syscalls.makedirs(d, exist_ok=True)
                except OSError as e:
                    raise FileIOError(e.errno, "mkdir", d) from e
                self._locks.append(WriteLock(d))
            except Exception:
                self._release_locks()
                raise
        try:
            self.pool = BufferPool(cfg.cpu_budget)
            # per direction: the config's fields where set, else the device profile's
            choice = io_choice.resolve(cfg, self.root)
            self.io = AsyncFileIO(threads=choice["threads"], read=choice["read"],
                                  write=choice["write"])
            self._io_report = choice["report"]
            self._io_controllers = choice["controllers"]
            self._io_seen = {"read": (0, 0.0), "write": (0, 0.0)}
            self.gpu = None
            if cfg.gpu_budget and torch.cuda.is_available():
                from .gpu_tier import GpuTier
                self.gpu = GpuTier(cfg.gpu_budget)
        except Exception:
            self._release_locks()
            raise
        self._arrays: dict[str, _Array] = {}
        self._manifest_extra: dict = {}  # entries of the layers above (the optimizer's tables)
        if self.root is not None:
            try:
                self._manifest_extra = open_store_group(self.root)
            except Exception:
                self.io.close()
                self.pool.close()
                self._release_locks()
                raise
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._resident: set[Bucket] = set()
        self._prefetch_queue: list[Bucket] = []
        # the step order, read-ahead, victims and write-back credit; the store reports to it
        # every change of a bucket that can make it an eviction candidate or not
        self._policy = ResidencyPolicy(cfg.prefetch_depth, cfg.alternate_order)
        self._write_errors: list[BaseException] = []
        self._tick = 0
        self._stats = StatsCounter()
        self._auto_bytes = {"gpu": 0, "cpu": 0}
        self._snapshot: Snapshot | None = None
        self._closed = False
        # The store's own thread: I/O threads only post their completions to it, and it
        # takes the lock, moves bucket states, wakes waiters and issues the next reads.
        self._completions = CompletionQueue("oe-store")
        # CUDA only: one thread waits for device->host copies before their write-backs
        self._copy_waiter = CompletionQueue("oe-copy-wait") if self.gpu is not None else None
        # a store dropped without close() must not leave its threads waiting forever
        self._stop_threads = weakref.finalize(self, _stop_queues, self._completions,
                                              self._copy_waiter)

    # -- arrays -----------------------------------------------------------------------------
    def register(self, name: str, dtype: torch.dtype, numel: int, home: str | None = None) -> _Array:
        """Declare a flat array of ``numel`` elements of ``dtype``.

        Nothing is written: buckets never touched read as zeros. An NVMe-home array that
        already exists in the store directory (from an earlier run) is reopened, and must
        have the same dtype and numel. Returns the array's description.
        """
        if not _NAME.match(name):
            raise InputError(f"array name {name!r}: use letters, digits, '_', '.', '-' and '/'")
        if numel < 0:
            raise InputError(f"array {name}: numel must be >= 0, got {numel}")
        dtypes.zarr_dtype(dtypes.dtype(dtype).name)  # raises for a dtype no array can hold
        itemsize = geometry.itemsize_of(dtype)
        with self._lock:
            if name in self._arrays:
                raise InputError(f"array {name} is already registered")
            home = self._choose_home(name, home, numel * itemsize)
            bucket_elems = geometry.elems_per_bucket(self.config.bucket_bytes, itemsize)
            arr = _Array(name, dtype, numel, itemsize, home, bucket_elems, [])
            spans = geometry.bucket_spans(numel, itemsize, self.config.bucket_bytes)
            for i, (start, stop) in enumerate(spans):
                arr.buckets.append(Bucket(arr, i, start, stop, (stop - start) * itemsize,
                                          pinned_home=home in ("cpu", "gpu")))
            if home == "nvme":
                arr.flat = self._open_or_create(arr)
                # the manifest first: an array it does not list is not registered, so a
                # failed write (a full disk) can be retried by registering again
                self._write_manifest({**self._arrays, name: arr}, self._manifest_extra)
            self._arrays[name] = arr
            return arr

    def _choose_home(self, name: str, home: str | None, nbytes: int) -> str:
        home = home or self.config.home_of(name)
        if home == "auto":
            # fill the GPU, then the pinned pool (keeping room for the NVMe working set), then NVMe
            reserve = (self.config.prefetch_depth + 2) * self.config.bucket_bytes
            if self.gpu is not None and self._auto_bytes["gpu"] + nbytes <= self.gpu.capacity:
                home = "gpu"
            elif self._auto_bytes["cpu"] + nbytes + reserve <= self.pool.capacity or not self.root:
                home = "cpu"
            else:
                home = "nvme"
            if home in self._auto_bytes:
                self._auto_bytes[home] += nbytes
        if home == "gpu" and self.gpu is None:
            raise InputError(f"array {name}: home tier 'gpu' needs CUDA and a gpu_budget > 0"
                             + ("" if torch.cuda.is_available() else " (CUDA is not available)"))
        if home == "nvme" and self.root is None:
            raise InputError(f"array {name}: home tier 'nvme' needs nvme_paths in the config")
        if home not in ("gpu", "cpu", "nvme"):
            raise InputError(f"array {name}: unknown home tier {home!r}")
        return home

    def _open_or_create(self, arr: _Array) -> FlatArray:
        path = os.path.join(self.root, arr.name)
        reopened = os.path.exists(os.path.join(path, "zarr.json"))
        if reopened:
            flat = FlatArray.open(path, io=self.io, mode="r+")
            if (flat.dtype != arr.dtype or flat.numel != arr.numel
                    or (flat.chunk_elems != arr.bucket_elems and len(arr.buckets) > 1)):
                raise InputError(
                    f"array {arr.name} in {path} has dtype {flat.dtype}, {flat.numel} elements and "
                    f"{flat.chunk_elems}-element chunks; asked for {arr.dtype}, {arr.numel} and "
                    f"{arr.bucket_elems}")
        else:
            flat = FlatArray.create(path, arr.numel, arr.dtype, io=self.io,
                                    chunk_bytes=self.config.bucket_bytes,
                                    attributes={"offload_engine": {"home": "nvme"}},
                                    dimension_name=FlatArray.dimension_for(arr.name))
        stripe_chunks(flat, arr.name, self._stripes)
        # asked once here (an array just made has no chunk files); from now on the store is
        # the array's only writer, so reads and writes trust this record, and the chunks
        # they create, instead of asking the file system at every access
        present = ({i for i in range(flat.nchunks) if os.path.exists(flat.chunk_path(i))}
                   if reopened else set())
        flat.track_chunks(present)
        ce = flat.chunk_elems
        for b in arr.buckets:
            b.on_disk = any(c in present for c in range(b.start // ce, -(-b.stop // ce)))
        return flat

    def _write_manifest(self, arrays: dict, extra: dict) -> None:
        """Rewrite the store group's manifest for ``arrays`` (name -> _Array) and the entries
        ``extra`` of the layers above; the caller records them once this returned."""
        entries = {a.name: store_array_entry(dtypes.dtype(a.dtype).name, a.numel, a.home,
                                             a.bucket_elems)
                   for a in arrays.values() if a.home == "nvme"}
        write_store_group(self.root, entries, self._stripes, extra)

    def earlier_run(self, names=()) -> EarlierRun | None:
        """What an earlier run left in the store directory (``store/earlier_run.py``): the
        arrays its manifest lists and those of ``names`` found on disk; None if nothing.
        Meaningful before anything is registered."""
        return None if self.root is None else find_earlier_run(self.root, names)

    def discard_earlier_run(self, earlier: EarlierRun) -> None:
        """Remove what ``earlier`` found (arrays, their striped chunks, the tables of the
        layers above) so that none of it is ever read as current state. The store holds
        the directory's write lock, so no live writer loses anything; call it before
        registering any array."""
        with self._lock:
            if self._arrays:
                raise UsageError("discard_earlier_run: arrays are registered already")
            remove_earlier_arrays(earlier, self._stripes)
            self._write_manifest({}, {})
            self._manifest_extra = {}

    def update_manifest(self, entries: dict) -> None:
        """Merge ``entries`` (JSON-serialisable) into the store's manifest (the group
        attributes, docs/format.md), e.g. the optimizer's ``tensors``, ``world_size`` and
        ``step``; rewritten atomically. The store's own keys cannot be overridden."""
        reserved = STORE_KEYS & set(entries)
        if reserved:
            raise InputError(f"manifest keys {sorted(reserved)} belong to the store")
        with self._lock:
            extra = {**self._manifest_extra, **entries}
            if self.root is not None:
                self._write_manifest(self._arrays, extra)
            self._manifest_extra = extra  # only once written: a failed write changes nothing

    def bucket_ranges(self, name: str) -> list[tuple[int, int]]:
        """The [start, stop) element ranges of ``name``'s buckets, in order."""
        return [(b.start, b.stop) for b in self._array(name).buckets]

    def arrays(self) -> dict[str, _Array]:
        return dict(self._arrays)

    def _array(self, name: str) -> _Array:
        try:
            return self._arrays[name]
        except KeyError:
            raise KeyError(f"no array named {name!r} is registered in this store") from None

    def _locate(self, name: str, rng) -> tuple[Bucket, int, int]:
        arr = self._array(name)
        if isinstance(rng, int):
            if not 0 <= rng < len(arr.buckets):
                raise IndexError(f"array {name} has {len(arr.buckets)} buckets; no bucket {rng}")
            b = arr.buckets[rng]
            return b, b.start, b.stop
        start, stop = rng
        if not 0 <= start <= stop <= arr.numel:
            raise IndexError(f"range [{start}, {stop}) is outside array {name} of {arr.numel} elements")
        if not arr.buckets:
            raise IndexError(f"array {name} is empty")
        b = arr.buckets[min(start // arr.bucket_elems, len(arr.buckets) - 1)]
        if stop > b.stop:
            raise InputError(f"range [{start}, {stop}) of {name} crosses a bucket boundary at "
                             f"element {b.stop}; acquire each bucket of bucket_ranges() separately")
        return b, start, stop

    # -- acquire / release -------------------------------------------------------------------
    def acquire(self, name: str, rng: tuple[int, int] | int, device: str | torch.device = "cpu") -> Handle:
        """Lend elements ``rng`` = (start, stop) (or a bucket index) of array ``name``.

        On "cpu" the tensor is a view of the pooled pinned buffer itself (no copy); on a CUDA
        device it is a GPU tensor filled by a side-stream copy the current stream waits for.
        Blocks while the bucket's read is in flight; raises PoolExhaustedError if no pinned
        space frees up within ``acquire_timeout_s``.
        """
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise InputError(f"acquire on {dev}: CUDA is not available on this machine")
        if dev.type not in ("cpu", "cuda"):
            raise InputError(f"acquire on {dev}: only 'cpu' and CUDA devices are supported")
        b, start, stop = self._locate(name, rng)
        arr = b.array
        if dev.type == "cuda" and self.gpu is None:
            raise InputError(f"acquire of {name} on {dev}: the store has no gpu tier (gpu_budget is 0)")
        if arr.home == "gpu" and dev.type != "cuda":
            raise InputError(f"array {name} lives on the GPU; acquire it with a CUDA device")
        with self._lock:
            self._check_open()
            self._policy.note_use(b.key)
            t0 = time.monotonic()
            b.refs += 1  # from now on: not a victim, even while we wait for its read
            self._update_candidate(b)
            try:
                waited = self._make_resident(b, demand=True)
            except BaseException:
                b.refs -= 1
                self._update_candidate(b)
                raise
            while b.saving:  # the snapshot thread is copying it: wait, it may be modified
                self._snapshot.caught_up = True
                self._cv.wait()
            copy_first = self._snapshot is not None and self._snapshot.take(b)
            if copy_first:
                b.saving = True
            self._tick += 1
            b.last_use = self._tick
            self._pump()
            if waited:
                self._stats.current.io_wait_s += time.monotonic() - t0
        if copy_first:
            self._copy_for_snapshot(b, inline=True)
        with self._lock:
            if dev.type == "cpu":
                if b.d2h_event is not None:
                    b.d2h_event.synchronize()  # a CPU user after a GPU one: bytes must have landed
                    self.gpu.events.give(b.d2h_event)
                    b.d2h_event = None
                self._settle_h2d(b)  # and must not change them while a copy reads them
                tensor = b.host_view(arr.dtype)[start - b.start:stop - b.start]
            else:
                try:
                    tensor = self._stage_on_gpu(b)[start - b.start:stop - b.start]
                except BaseException:  # gpu tier full: the bucket is not lent after all
                    b.refs -= 1
                    self._update_candidate(b)
                    self._cv.notify_all()
                    raise
        return Handle(name, start, stop, dev, tensor, b)

    def keep(self, name: str, index: int) -> Handle:
        """Keep bucket ``index`` of array ``name`` in the pinned pool until the handle is
        released (never a victim), without lending its bytes: ``handle.tensor`` is None and
        changes go through ``acquire``, so a ``snapshot`` may run while it is kept."""
        h = self.acquire(name, index, device="cpu")
        with self._lock:
            h._bucket.keeps += 1
        h.tensor = None
        h.keep = True
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
            handle._released = True
            if handle.keep:
                b.keeps -= 1
            if handle.device.type == "cuda":
                self._unstage_from_gpu(b, dirty)
            b.refs -= 1
            if dirty and b.array.home == "nvme":
                b.dirty = True
            self._update_candidate(b)
            self._pump()
            self._cv.notify_all()

    def _update_candidate(self, b: Bucket) -> None:
        """Tell the policy whether ``b`` may be evicted now (after any change of its state,
        references, dirtiness or write failure)."""
        if b.state == RESIDENT and not b.refs and not b.pinned_home and not b.write_failed:
            self._policy.offer(b.key, b.dirty, b.last_use)
        else:
            self._policy.withdraw(b.key)

    def _make_resident(self, b: Bucket, demand: bool) -> bool:
        """Bring ``b`` into its buffer; returns whether the caller had to wait."""
        deadline = time.monotonic() + self.config.acquire_timeout_s
        waited = False
        counted = False
        retried = False
        while True:
            if b.error is not None:
                err, b.error = b.error, None
                raise err
            if b.state == RESIDENT:
                if not counted:
                    self._stats.current.hits += 1
                return waited
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
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                held = sum(1 for r in self._resident if r.refs)
                raise PoolExhaustedError(
                    f"acquire of {b.array.name} bucket {b.index} ({b.nbytes} bytes): no pinned space "
                    f"freed within {self.config.acquire_timeout_s:.1f} s; {self.pool.in_use} of "
                    f"{self.pool.capacity} bytes in use, {held} buckets held by acquire() without "
                    f"release(). Release handles sooner or raise cpu_budget.")
            waited = True
            self._cv.wait(remaining)

    # -- filling and eviction -----------------------------------------------------------------
    def _fill(self, b: Bucket, demand: bool, credit: Credit | None = None) -> str:
        """Start bringing ``b`` in: "started", "pending" (space is being freed) or "none".

        ``credit``: bytes that write-backs in flight will free and that no earlier fill of
        this prefetch pass has claimed: while it covers ``b``, no further bucket is evicted.
        """
        arr = b.array
        if arr.home == "gpu":
            off = self.gpu.alloc(b.nbytes)
            if off is None:
                raise UsageError(f"gpu tier full: cannot hold {arr.name} bucket {b.index}")
            b.gpu_offset = off
            self.gpu.view(off, b.nbytes, torch.uint8).zero_()
            b.state = RESIDENT
            self._stats.current.zero_fills += 1
            return "started"
        if credit is None:
            credit = self._policy.writebacks.credit()
        buf, status = self._get_buffer(b, demand, credit)
        if buf is None:
            return status
        b.buf = buf
        self._resident.add(b)
        if arr.home != "nvme" or not b.on_disk:
            buf.bytes.zero_()  # first touch: zeros, nothing read, nothing written
            b.state = RESIDENT
            self._update_candidate(b)
            self._stats.current.zero_fills += 1
            self._cv.notify_all()
            return "started"
        b.state = READING
        fut = _started(arr.flat.read_into, b.start, b.stop, buf)
        fut.add_done_callback(lambda f, b=b: self._completions.post(self._read_done, b, f))
        return "started"

    def _read_done(self, b: Bucket, fut) -> None:
        """A read landed (on the store's thread, oe-store)."""
        with self._lock:
            err = fut.exception()
            if err is not None:
                err = for_bucket("read", b, err)
                if b.refs:  # an acquire waits for these bytes: it raises the error
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
            buf = self.pool.try_acquire(b.nbytes)
            if buf is not None:
                return buf, "ok"
            if credit.claim(b.nbytes):
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
        written with ``evict_after``). The outcome reaches ``_write_done`` like any
        write-back's: on success the room they free lets a waiting fill go on."""
        for r in [r for r in self._resident
                  if r.write_failed and r.state == RESIDENT and not r.refs]:
            r.write_failed = False
            if r.dirty:
                self._start_write(r, evict_after=evict_after)
            else:
                self._update_candidate(r)

    def _settle_h2d(self, b: Bucket) -> None:
        """Wait until a copy of ``b``'s pinned bytes to the GPU has read them (before the
        buffer is freed, or changed by a CPU user)."""
        if b.h2d_event is not None:
            b.h2d_event.synchronize()
            self.gpu.events.give(b.h2d_event)
            b.h2d_event = None

    def _drop(self, b: Bucket, count: bool = True) -> None:
        if b.d2h_event is not None:
            self.gpu.events.give(b.d2h_event)
            b.d2h_event = None
        self._settle_h2d(b)  # the pool may hand the buffer to the next read at once
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
        b.state = WRITING
        self._policy.writebacks.start(b.key, b.buf.capacity, evict_after)
        self._policy.withdraw(b.key)
        b.dirty = False
        event, b.d2h_event = b.d2h_event, None
        if event is not None:
            # bytes are still arriving from the GPU: the copy waiter thread waits for them
            # (in order: one side stream) and then starts the write, never under this lock
            self._copy_waiter.post(self._write_after_copy, b, event)
            return
        self._write(b)

    def _write_after_copy(self, b: Bucket, event) -> None:
        """On the copy waiter thread: wait for ``b``'s device->host copy, then write it."""
        try:
            event.synchronize()
        except Exception as e:  # the write-back fails like an I/O error: flush reports it
            self._completions.post(self._write_done, b, _failed(e))
            return
        self.gpu.events.give(event)
        self._write(b)

    def _write(self, b: Bucket) -> None:
        """Start writing ``b``'s buffer home; its outcome reaches ``_write_done`` on oe-store."""
        fut = _started(b.array.flat.write_from, b.start, b.stop, b.buf)
        fut.add_done_callback(lambda f, b=b: self._completions.post(self._write_done, b, f))

    def _write_done(self, b: Bucket, fut) -> None:
        """A write-back landed or failed (on the store's thread, oe-store)."""
        with self._lock:
            evict = self._policy.writebacks.finish(b.key) and b.refs == 0
            err = fut.exception()
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

    # -- GPU staging --------------------------------------------------------------------------
    def _stage_on_gpu(self, b: Bucket) -> torch.Tensor:
        dtype = b.array.dtype
        if b.array.home == "gpu":
            return self.gpu.view(b.gpu_offset, b.nbytes, dtype)
        if b.gpu_users == 0:
            off = self.gpu.alloc(b.nbytes)
            if off is None:
                raise UsageError(f"gpu tier full: cannot stage {b.array.name} bucket {b.index} "
                                   f"({b.nbytes} bytes); raise gpu_budget")
            b.gpu_offset = off
            self._settle_h2d(b)
            b.h2d_event = self.gpu.copy_in(self.gpu.view(off, b.nbytes, torch.uint8), b.buf.bytes)
            self._stats.current.bytes_read["cpu"] += b.nbytes
            self._stats.current.bytes_written["gpu"] += b.nbytes
        b.gpu_users += 1
        return self.gpu.view(b.gpu_offset, b.nbytes, dtype)

    def _unstage_from_gpu(self, b: Bucket, dirty: bool) -> None:
        if b.array.home == "gpu":
            return
        b.gpu_users -= 1
        if dirty:
            if b.d2h_event is not None:
                # superseded: the new copy runs after it on the same stream
                self.gpu.events.give(b.d2h_event)
            b.d2h_event = self.gpu.copy_out(b.buf.bytes, self.gpu.view(b.gpu_offset, b.nbytes, torch.uint8))
            self._stats.current.bytes_read["gpu"] += b.nbytes
            self._stats.current.bytes_written["cpu"] += b.nbytes
        if b.gpu_users == 0:
            # later copies into this extent run on the same side stream, after the copy-out
            self.gpu.free(b.gpu_offset, b.nbytes)
            b.gpu_offset = None

    # -- schedule ------------------------------------------------------------------------------
    def set_schedule(self, forward: list[tuple[str, int]] | None,
                     backward: list[tuple[str, int]] | None = None) -> None:
        """Declare the per-step bucket orders once: ``forward`` (``(array, bucket_index)``
        pairs, each bucket at most once) and ``backward``, the same buckets in the order a
        reversed walk first uses them (default: ``forward`` reversed). With
        ``alternate_order`` the store walks ``forward`` on even steps and ``backward`` on odd
        ones, counting from the next ``begin_step``; otherwise ``forward`` every step. None
        clears the schedule."""
        with self._lock:
            if forward is None:
                self._policy.clear()
                return
            forward = [tuple(k) for k in forward]
            backward = None if backward is None else [tuple(k) for k in backward]
            for name, idx in forward + (backward or []):
                if not 0 <= idx < len(self._array(name).buckets):
                    raise IndexError(f"schedule names bucket {idx} of {name}, which has "
                                     f"{len(self._array(name).buckets)}")
            self._policy.declare(forward, backward)

    def begin_step(self) -> list[tuple[str, int]] | None:
        """Mark a step boundary; returns the bucket order to use in this step (the store
        owns the order: the declared one, alternating when ``alternate_order``;
        ``step_is_backward`` says which).

        Without a declared schedule, the first step's acquire order is recorded and becomes
        the schedule from the second step on (None is returned while recording).
        """
        with self._lock:
            # write-backs that failed (a full disk) are tried again once per step, so their
            # bytes reach the disk as soon as it has room, with no flush() needed
            self._retry_failed_writes(evict_after=False)
            self._adapt_io()
            order = self._policy.begin_step()
            if order is None:
                return None
            self._pump()
            return list(order)

    def _adapt_io(self) -> None:
        """Feed each direction's controller what moved since the last step (bytes, busy
        seconds) and apply the settings it steps to (io/adaptive.py)."""
        st = self.io.stats
        for op, ctl in self._io_controllers.items():
            moved = st.bytes_read if op == "read" else st.bytes_written
            busy = st.read_busy_s if op == "read" else st.write_busy_s
            last_moved, last_busy = self._io_seen[op]
            self._io_seen[op] = (moved, busy)
            new = ctl.feed(moved - last_moved, busy - last_busy)
            if new is not None:
                log.info("%s", io_choice.describe_change(op, *ctl.changes[-1]))
                self.set_io_settings(op, new)

    def set_io_settings(self, op: str, settings) -> None:
        """Use ``settings`` (io.settings.DirectionSettings) for ``op`` ("read" or "write")
        from now on; bytes already written read back the same in every mode."""
        self.io.set_settings(op, settings)
        self._io_report[op] = {**settings.as_dict(),
                               "sources": {k: settings.source for k in FIELDS}}

    def io_settings(self) -> dict:
        """The I/O settings in force per direction and where they came from: {"read":
        {"mode", "queue_depth", "block_bytes", "streams", "source", "sources"}, "write": ...,
        "threads",
        "profile": {"source", "file", "measured_at"}, "adaptive": directions watched,
        "changes": how many times the adaptive controller stepped}."""
        out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self._io_report.items()}
        out["changes"] = sum(len(c.changes) for c in self._io_controllers.values())
        return out

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
                b, _, _ = self._locate(name, rng)
                if b.state == ABSENT and b not in self._prefetch_queue:
                    self._prefetch_queue.append(b)
            self._pump()

    # -- snapshots -----------------------------------------------------------------------------
    def snapshot(self, sink, arrays: list[str] | None = None) -> Snapshot:
        """Copy ``arrays`` (default: all) as they are now, in the background.

        ``sink(array, bucket_index, start_element, tensor)`` is called once per bucket, from
        a background thread or from an ``acquire`` that needs the bucket first (so later
        changes never reach the copy). Returns at once; ``Snapshot.wait()`` blocks until
        done and raises the sink's first error. One snapshot at a time.
        """
        with self._lock:
            self._check_open()
            if self._snapshot is not None and not self._snapshot.finished.is_set():
                raise UsageError("a snapshot of this store is still being taken")
            held = sorted(b.key for b in self._resident if b.refs > b.keeps)
            if held:
                raise UsageError(f"snapshot while buckets are held ({held[:3]}...): take it "
                                   "between steps, when every handle is released")
            names = list(self._arrays) if arrays is None else arrays
            # in the order of the step to come: the buckets it needs first are copied first,
            # so its acquires rarely find one still to copy (a copy on the training thread)
            sched = self._policy.schedule
            order = [self._bucket(k) for k in sched.order_for(sched.step + 1)] if sched else []
            wanted = {b for n in names for b in self._array(n).buckets}
            buckets = [b for b in order if b in wanted]
            scheduled = set(buckets)
            buckets += [b for n in names for b in self._array(n).buckets if b not in scheduled]
            snap = Snapshot(buckets, sink)
            self._snapshot = snap
            threading.Thread(target=self._snapshot_worker, args=(snap,), name="oe-snapshot",
                             daemon=True).start()
            return snap

    def _snapshot_worker(self, snap: Snapshot) -> None:
        try:
            while True:
                with self._lock:
                    b = snap.next_bucket()
                    if b is None:
                        break
                    b.saving = True
                    b.refs += 1
                    self._update_candidate(b)
                    try:
                        self._make_resident(b, demand=True)
                    except BaseException as e:  # the finally below abandons the rest
                        b.refs -= 1
                        self._update_candidate(b)
                        b.saving = False
                        snap.fail(e)
                        snap.settle(1)  # the bucket it had claimed
                        self._cv.notify_all()
                        break
                self._copy_for_snapshot(b, inline=False)
        except BaseException as e:  # never leave wait() hanging
            snap.fail(e)
        finally:
            with self._lock:
                if snap.error is not None:
                    snap.abandon_unclaimed()

    def _copy_for_snapshot(self, b: Bucket, inline: bool) -> None:
        """Hand ``b``'s bytes to the snapshot's sink (``b`` is held and marked saving). An
        inline copy runs in the acquire that holds ``b``; the background thread's copy holds
        it itself and lets it go here."""
        snap = self._snapshot
        try:
            try:
                if b.array.home == "gpu":
                    tensor = self.gpu.view(b.gpu_offset, b.nbytes, b.array.dtype)
                else:
                    event = b.d2h_event  # read once: a write-back may take it meanwhile
                    if event is not None:
                        event.synchronize()
                    tensor = b.host_view(b.array.dtype)
            except BaseException as e:  # the claimed bucket must settle, or wait() never ends
                snap.fail(e)
                snap.settle(1)
            else:
                snap.copy(b, tensor, inline)
        finally:
            with self._lock:
                b.saving = False
                if not inline:
                    b.refs -= 1
                    self._update_candidate(b)
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
            self._snapshot.finished.wait()
        try:
            if self.root is not None:
                self.flush()
        finally:
            with self._lock:
                self._closed = True
            # after the flush no write-back waits for a copy; then every I/O ends (and posts
            # its completion), then the store's thread handles what was posted and ends
            if self._copy_waiter is not None and not self._copy_waiter.close(_THREAD_JOIN_S):
                log.warning("store close: the CUDA copy waiter did not end within %d s",
                            _THREAD_JOIN_S)
            self.io.close()
            if not self._completions.close(_THREAD_JOIN_S):
                log.warning("store close: thread oe-store did not end within %d s",
                            _THREAD_JOIN_S)
            self._stop_threads.detach()
            self.pool.close()
            self._release_locks()

    def _release_locks(self) -> None:
        for lock in self._locks:
            lock.release()
        self._locks = []

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("the store is closed")

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _started(start_io, *args) -> IOFuture:
    """``start_io(*args)``'s future; an error raised at the call comes back through the
    future too, so the bucket's state machine always hears how its I/O ended."""
    try:
        return start_io(*args)
    except Exception as e:
        return _failed(e)


def _failed(error: BaseException) -> IOFuture:
    """A future that ended with ``error``."""
    fut = IOFuture()
    fut.set_running_or_notify_cancel()
    fut.set_exception(error)
    return fut


def _stop_queues(*queues) -> None:
    for q in queues:
        if q is not None:
            q.stop()
