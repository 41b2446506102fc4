"""The GPU tier: buckets homed in device memory, and pinned buckets staged there for CUDA users.

One preallocated arena (``gpu_budget`` bytes) is carved into 4096-aligned extents. Copies
between the pinned pool and the arena run on one side stream and are ordered with the
compute stream by events, so the host never blocks on the hot path. The ordering rules,
each one a method below:

- copy-in (``stage``): the side stream first waits for the compute stream (the extent may
  still be read by earlier kernels); the compute stream waits for the copy on the GPU. The
  pinned bytes it reads must not change or go back to the pool before its event completed
  (``settle_copy_in``, called before a CPU user or a free of the buffer).
- copy-out (``unstage`` of a dirty bucket): runs after the compute stream's pending work.
  The host bytes are valid only once its event completed: a write-back waits for it on the
  store's copy waiter thread (``write_when_copied``), a CPU user of the bucket in
  ``before_host_use``, a snapshot in ``bytes_now``.
- the extent of an unstaged bucket is freed at once: every later copy into it runs on the
  same side stream, after the copy-out; a gpu-home bucket placed in it (``place``) makes
  the compute stream wait for the side stream first.

Events come from a small pool and go back to it once waited on, so a step records no new
events. The device operations (streams, events, copies, the arena) come from a ``device``
object: ``CudaDevice`` in production, built only when ``torch.cuda.is_available()``; the
tests pass a CPU stand-in that records the order of copies, records and waits.
"""

from __future__ import annotations

import threading

import torch

from ..errors import UsageError
from ..io.align import round_up
from ..io.extents import Extents


class CudaDevice:
    """The CUDA operations the GPU tier uses, on ``device`` (default: the current one)."""

    def __init__(self, device: torch.device | None = None):
        if not torch.cuda.is_available():
            raise UsageError("the gpu tier needs CUDA, which is not available")
        self.device = device or torch.device("cuda", torch.cuda.current_device())

    def empty(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` bytes of device memory (uint8, uninitialised)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def copy_on(self, stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue ``dst.copy_(src)`` on ``stream`` without blocking the host."""
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)


class EventPool:
    """Reusable events (``new_event()`` makes one), shared by the threads of one store.

    An event can be taken again once nobody will wait on its last record: after a host
    ``synchronize`` returned, or once every ``wait_event`` on it was enqueued (a wait
    captures the record it saw). Every event of a store is recorded on its one side stream,
    so a late ``synchronize`` on a record that was reused waits for a later copy on that
    stream, never returns early. At most ``keep`` free events are kept.
    """

    def __init__(self, new_event, keep: int = 16):
        self._new_event = new_event
        self._free: list = []
        self._lock = threading.Lock()
        self._keep = keep
        self.created = 0      # events made so far (flat over a run: they are reused)

    def take(self):
        with self._lock:
            if self._free:
                return self._free.pop()
            self.created += 1
        return self._new_event()

    def give(self, event) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(event)


class GpuStaging:
    """``budget_bytes`` of device memory (rounded up to 4096) for gpu-home buckets and
    staged copies of pinned ones.

    Args:
        budget_bytes: bytes of the arena.
        device: the device operations (``CudaDevice`` or a stand-in with the same methods).
        counters: the store's StatsCounter; staging counts the bytes its copies move.
        copy_waiter: the store's CompletionQueue thread that waits for copy-outs before
            their write-backs (``write_when_copied``).

    Not thread-safe: the store calls it under its lock; off the lock only the copy waiter
    thread's waits and ``bytes_now`` (the snapshot thread) run, and they touch only events.
    """

    def __init__(self, budget_bytes: int, device, counters, copy_waiter,
                 slot_bytes: int = 0):
        self.device = device
        # a staged bucket, however short, takes a whole bucket's slot; gpu-homed buckets
        # (kept) come from the top: equal slots never leave a bucket's room in pieces
        self.slot_bytes = round_up(slot_bytes) if slot_bytes else 0
        self._copy_waiter = copy_waiter
        self.capacity = round_up(budget_bytes)
        self.arena = device.empty(self.capacity)
        self.extents = Extents(self.capacity)
        self.stream = device.new_stream()
        self.events = EventPool(device.new_event)
        self._counters = counters

    # -- the arena -------------------------------------------------------------------------
    def _extent(self, nbytes: int, kept: bool) -> int:
        """Arena bytes a bucket of ``nbytes`` takes: its own size rounded to 4096 when
        ``kept`` (gpu-homed), else at least a slot (as long as the arena holds one)."""
        size = round_up(max(nbytes, 1))
        return size if kept else max(size, min(self.slot_bytes, self.capacity))

    def alloc(self, nbytes: int, kept: bool = False) -> int | None:
        """Offset of a free extent for ``nbytes`` of device memory (``_extent``), or None;
        ``kept`` ones from the top of the arena."""
        return self.extents.take(self._extent(nbytes, kept), top=kept)

    def free(self, offset: int, nbytes: int, kept: bool = False) -> None:
        self.extents.give(offset, self._extent(nbytes, kept))

    def view(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return self.arena[offset:offset + nbytes].view(dtype)

    @property
    def in_use(self) -> int:
        return self.extents.in_use

    @property
    def peak_in_use(self) -> int:
        return self.extents.peak_in_use

    # -- copies on the side stream -----------------------------------------------------------
    def copy_in(self, dst: torch.Tensor, src_pinned: torch.Tensor):
        """Host -> device on the side stream; the current stream waits for it on the GPU.
        Returns the event that marks ``src_pinned`` read: the host must not reuse those
        pinned bytes (evict the bucket, read another one into them) before it has
        completed (give it back with ``events.give`` once synchronized)."""
        compute = self.device.current_stream()
        self.stream.wait_stream(compute)  # dst may still be read by earlier kernels
        done = self.events.take()
        self.device.copy_on(self.stream, dst, src_pinned)
        done.record(self.stream)
        compute.wait_event(done)
        return done

    def copy_out(self, dst_pinned: torch.Tensor, src: torch.Tensor):
        """Device -> host on the side stream after the compute stream's pending work;
        returns the event that marks the host bytes valid (give it back with
        ``events.give`` once synchronized)."""
        self.stream.wait_stream(self.device.current_stream())
        done = self.events.take()
        self.device.copy_on(self.stream, dst_pinned, src)
        done.record(self.stream)
        return done

    # -- buckets ---------------------------------------------------------------------------
    def place(self, b) -> None:
        """Give gpu-home bucket ``b`` its extent, zeroed (its first and only fill). The
        extent may have been a staged bucket's whose copy-out is still on the side stream:
        the compute stream, which zeroes it and runs its users, waits for that first."""
        off = self.alloc(b.nbytes, kept=True)
        if off is None:
            raise UsageError(f"gpu tier full: cannot hold {b.array.name} bucket {b.index}")
        b.gpu_offset = off
        self.device.current_stream().wait_stream(self.stream)
        self.view(off, b.nbytes, torch.uint8).zero_()

    def home_view(self, b) -> torch.Tensor:
        """Gpu-home bucket ``b``'s bytes as its array's dtype."""
        return self.view(b.gpu_offset, b.nbytes, b.array.dtype)

    def stage(self, b) -> torch.Tensor:
        """``b``'s bytes on the GPU for one more user (a copy-in for the first one)."""
        if b.array.home == "gpu":
            return self.home_view(b)
        if b.gpu_users == 0:
            off = self.alloc(b.nbytes)
            if off is None:
                raise UsageError(f"gpu tier full: cannot stage {b.array.name} bucket {b.index} "
                                 f"({b.nbytes} bytes); raise gpu_budget")
            b.gpu_offset = off
            self.settle_copy_in(b)
            b.h2d_event = self.copy_in(self.view(off, b.nbytes, torch.uint8), b.buf.bytes)
            stats = self._counters.current
            stats.bytes_read["cpu"] += b.nbytes
            stats.bytes_written["gpu"] += b.nbytes
        b.gpu_users += 1
        return self.home_view(b)

    def unstage(self, b, dirty: bool) -> None:
        """One GPU user of ``b`` is done; ``dirty``: copy its bytes back to the pinned buffer.
        The last user frees the extent."""
        if b.array.home == "gpu":
            return
        b.gpu_users -= 1
        if dirty:
            if b.d2h_event is not None:
                # superseded: the new copy runs after it on the same stream
                self.events.give(b.d2h_event)
            b.d2h_event = self.copy_out(b.buf.bytes, self.view(b.gpu_offset, b.nbytes, torch.uint8))
            stats = self._counters.current
            stats.bytes_read["gpu"] += b.nbytes
            stats.bytes_written["cpu"] += b.nbytes
        if b.gpu_users == 0:
            # later copies into this extent run on the same side stream, after the copy-out
            self.free(b.gpu_offset, b.nbytes)
            b.gpu_offset = None

    def settle_copy_in(self, b) -> None:
        """Wait until a copy of ``b``'s pinned bytes to the GPU has read them (before the
        buffer is freed, or changed by a CPU user)."""
        if b.h2d_event is not None:
            b.h2d_event.synchronize()
            self.events.give(b.h2d_event)
            b.h2d_event = None

    def before_host_use(self, b) -> None:
        """Before a CPU user gets ``b``'s pinned bytes: the last copy from the GPU has
        landed in them, and no copy to the GPU still reads them."""
        if b.d2h_event is not None:
            b.d2h_event.synchronize()
            self.events.give(b.d2h_event)
            b.d2h_event = None
        self.settle_copy_in(b)

    def forget(self, b) -> None:
        """``b``'s buffer goes back to the pool (its bytes are on disk or dropped): no copy
        may still read it; a copy-out still pending is not needed any more."""
        if b.d2h_event is not None:
            self.events.give(b.d2h_event)
            b.d2h_event = None
        self.settle_copy_in(b)

    def write_when_copied(self, b, write, fail) -> bool:
        """If a copy-out of ``b`` is on its way (a GPU user changed it), have the copy waiter
        thread wait for it and then call ``write(b)`` (``fail(b, error)`` if the wait
        fails), and return True; False when there is none to wait for. In order: one side
        stream, one waiter."""
        event, b.d2h_event = b.d2h_event, None
        if event is None:
            return False
        self._copy_waiter.post(self._write_after_copy, b, event, write, fail)
        return True

    def _write_after_copy(self, b, event, write, fail) -> None:
        try:
            event.synchronize()
        except Exception as e:  # the write-back fails like an I/O error: flush reports it
            fail(b, e)
            return
        self.events.give(event)
        write(b)

    def bytes_now(self, b) -> torch.Tensor:
        """``b``'s bytes as they are now, for a reader that does not hold the store lock (a
        snapshot): a gpu-home bucket's on the GPU; else its pinned buffer, once a copy-out
        still on its way landed (its event is left to its owner: a write-back may take it
        meanwhile)."""
        if b.array.home == "gpu":
            return self.home_view(b)
        event = b.d2h_event  # read once
        if event is not None:
            event.synchronize()
        return b.host_view(b.array.dtype)
