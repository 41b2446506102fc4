"""GPU memory for state: one preallocated arena and a side stream for host<->device copies.

Copies run on the side stream and are ordered with the compute stream by events, so the
host never blocks: the compute stream waits for a copy-in on the GPU, and a copy-out is
awaited (``event.synchronize()``) only by the store's copy waiter thread before it writes
the bytes to disk, or by a CPU user of the same bucket. Events come from a small pool and
go back to it once waited on, so a step records no new CUDA events.
Only constructed when ``torch.cuda.is_available()``; never run in CI (no GPU there).
"""

from __future__ import annotations

import threading

import torch

from ..io.align import round_up
from ..io.extents import Extents
from ..errors import UsageError


class EventPool:
    """Reusable ``torch.cuda.Event`` objects, shared by the threads of one store.

    An event can be taken again once nobody will wait on its last record: after a host
    ``synchronize`` returned, or once every ``wait_event`` on it was enqueued (a wait
    captures the record it saw). Every event of a store is recorded on its one side stream,
    so a late ``synchronize`` on a record that was reused waits for a later copy on that
    stream, never returns early. At most ``keep`` free events are kept.
    """

    def __init__(self, keep: int = 16):
        self._free: list = []
        self._lock = threading.Lock()
        self._keep = keep
        self.created = 0      # events made so far (flat over a run: they are reused)

    def take(self) -> torch.cuda.Event:
        with self._lock:
            if self._free:
                return self._free.pop()
            self.created += 1
        return torch.cuda.Event()

    def give(self, event: torch.cuda.Event) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(event)


class GpuTier:
    """``budget_bytes`` of device memory carved into extents (bytes, 4096-aligned)."""

    def __init__(self, budget_bytes: int, device: torch.device | None = None):
        if not torch.cuda.is_available():
            raise UsageError("the gpu tier needs CUDA, which is not available")
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.capacity = round_up(budget_bytes)
        self.arena = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        self.extents = Extents(self.capacity)
        self.stream = torch.cuda.Stream(self.device)
        self.events = EventPool()

    def alloc(self, nbytes: int) -> int | None:
        """Offset of ``nbytes`` (rounded to 4096) of free device memory, or None."""
        return self.extents.take(round_up(max(nbytes, 1)))

    def free(self, offset: int, nbytes: int) -> None:
        self.extents.give(offset, round_up(max(nbytes, 1)))

    def view(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return self.arena[offset:offset + nbytes].view(dtype)

    def copy_in(self, dst: torch.Tensor, src_pinned: torch.Tensor) -> torch.cuda.Event:
        """Host -> device on the side stream; the current stream waits for it on the GPU.
        Returns the event that marks ``src_pinned`` read: the host must not reuse those
        pinned bytes (evict the bucket, read another one into them) before it has
        completed (give it back with ``events.give`` once synchronized)."""
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # dst may still be read by earlier kernels
        done = self.events.take()
        with torch.cuda.stream(self.stream):
            dst.copy_(src_pinned, non_blocking=True)
            done.record(self.stream)
        compute.wait_event(done)
        return done

    def copy_out(self, dst_pinned: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
        """Device -> host on the side stream after the compute stream's pending work;
        returns the event that marks the host bytes valid (give it back with
        ``events.give`` once synchronized)."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        done = self.events.take()
        with torch.cuda.stream(self.stream):
            dst_pinned.copy_(src, non_blocking=True)
            done.record(self.stream)
        return done

    @property
    def in_use(self) -> int:
        return self.extents.in_use

    @property
    def peak_in_use(self) -> int:
        return self.extents.peak_in_use
