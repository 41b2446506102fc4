"""One pinned, page-aligned host arena with a fixed byte budget, carved into buffers on demand.

The arena is allocated once (anonymous mmap) and, when CUDA is present, registered with
``cudaHostRegister`` so host<->device copies from it are true async DMA. Requests are served
first-fit from a free list of page-aligned extents and coalesced on release; no memory is
allocated per request. When the budget is in use, ``acquire`` waits (bounded by a timeout)
for releases; a request larger than the whole budget fails at once.

Buffers are memoryviews of the arena or, for the store and the optimizer, torch tensors over
the same bytes (``torch.frombuffer`` of the arena, made on first use). A pool used through
memoryviews only (consolidate) never imports torch, whose import takes longer than that
whole command.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref

from .align import ALIGN, address_of, aligned_host_region, round_up
from .extents import Extents
from .errors import PoolExhaustedError, RequestTooLargeError
from ..errors import InputError, UsageError
from ..interrupts import InterruptSafeCondition

log = logging.getLogger(__name__)


class PooledBuffer:
    """A page-aligned slice of the pool's arena, valid until ``release()``.

    ``nbytes`` is what was asked for; ``capacity`` (a multiple of 4096) is what is held.
    """

    __slots__ = ("pool", "offset", "nbytes", "capacity", "_released")

    def __init__(self, pool: "BufferPool", offset: int, nbytes: int, capacity: int):
        self.pool = pool
        self.offset = offset
        self.nbytes = nbytes
        self.capacity = capacity
        self._released = False

    @property
    def bytes(self):
        """uint8 torch tensor of ``nbytes`` elements over the buffer (no copy; imports torch)."""
        self._check()
        return self.pool._arena[self.offset:self.offset + self.nbytes]

    def view(self, dtype, numel: int | None = None):
        """The buffer as a 1-D torch tensor of ``dtype`` (a torch dtype) with ``numel``
        elements (default: all that fit). Imports torch."""
        self._check()
        itemsize = dtype.itemsize
        if numel is None:
            numel = self.nbytes // itemsize
        if numel * itemsize > self.capacity:
            raise InputError(f"{numel} elements of {dtype} need {numel * itemsize} bytes; "
                             f"buffer holds {self.capacity}")
        raw = self.pool._arena[self.offset:self.offset + numel * itemsize]
        return raw.view(dtype)

    def memoryview(self, nbytes: int | None = None) -> memoryview:
        """Writable byte memoryview over the first ``nbytes`` (default ``nbytes``) of the buffer."""
        self._check()
        n = self.nbytes if nbytes is None else nbytes
        if n > self.capacity:
            raise InputError(f"{n} bytes exceed the buffer's {self.capacity}")
        return self.pool._view[self.offset:self.offset + n]

    def data_ptr(self) -> int:
        """Address of the buffer's first byte."""
        return self.pool.address + self.offset

    def release(self) -> None:
        """Give the bytes back to the pool; a second call is an error."""
        self.pool.release(self)

    def _check(self) -> None:
        if self._released:
            raise UsageError("use of a pooled buffer after release")

    def __enter__(self) -> "PooledBuffer":
        return self

    def __exit__(self, *exc) -> None:
        if not self._released:
            self.release()

    def __repr__(self) -> str:
        return f"PooledBuffer(offset={self.offset}, nbytes={self.nbytes})"


class BufferPool:
    """A fixed budget of page-aligned (and, with CUDA, pinned) host memory.

    Args:
        budget_bytes: total bytes of the arena, rounded up to 4096.
        pin: register the arena with CUDA; default (None): when ``torch.cuda.is_available()``,
            asked only once torch is imported (see ``_decide_pin``).
    """

    def __init__(self, budget_bytes: int, *, pin: bool | None = None):
        if budget_bytes <= 0:
            raise InputError(f"buffer pool budget must be positive, got {budget_bytes} bytes")
        self.capacity = round_up(budget_bytes)
        self._mmap = aligned_host_region(self.capacity)
        self._view = memoryview(self._mmap)
        self.address = address_of(self._view)  # of the arena's first byte (page-aligned)
        self._tensor = None  # uint8 torch tensor over the arena, made on first torch use
        self.pinned = False
        self._pin_undecided = pin is None
        self._extents = Extents(self.capacity)
        self._cond = InterruptSafeCondition()  # the free list is never left half updated
        self._closed = False
        if pin:
            self._pin()
        elif pin is None and "torch" in sys.modules:
            self._decide_pin()

    # -- torch views and pinning (CUDA only) ---------------------------------------------
    @property
    def _arena(self):
        """uint8 torch tensor over the whole arena; torch is imported on first use, and a
        pool created with ``pin=None`` before torch was imported is pinned then if CUDA is
        available."""
        tensor = self._tensor
        if tensor is None:
            with self._cond:
                if self._closed:
                    raise UsageError("buffer pool is closed")
                if self._tensor is None:
                    import torch

                    self._tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
                    if self._pin_undecided:
                        self._decide_pin()
                tensor = self._tensor
        return tensor

    def _decide_pin(self) -> None:
        """``pin=None``: pin when CUDA is available. Asked only once torch is imported (by
        someone else, or for a torch view of the arena): a process that never imported
        torch has no CUDA tensors to copy to or from, and importing torch only to find out
        would cost more than a short command (consolidate) takes in all."""
        import torch

        self._pin_undecided = False
        if torch.cuda.is_available():
            self._pin()

    def _pin(self) -> None:
        import torch

        self._pin_undecided = False
        if not torch.cuda.is_available():
            raise UsageError("pin=True asks for CUDA-pinned memory, but CUDA is not available")
        rc = torch.cuda.cudart().cudaHostRegister(self.address, self.capacity, 0)
        if int(rc) != 0:
            raise UsageError(f"cudaHostRegister of {self.capacity} bytes failed with code {int(rc)}")
        self.pinned = True
        # A pool dropped without close() must not leave its range registered: the arena is
        # unmapped with the pool, and the next mapping at that address could not be pinned
        # (cudaHostRegister: 712, already registered). Not at exit: the process ends anyway.
        self._unregister = weakref.finalize(self, _cuda_host_unregister, self.address)
        self._unregister.atexit = False

    def _unpin(self) -> None:
        if self.pinned:
            self._unregister()
            self.pinned = False

    def prefault(self, offset: int = 0, nbytes: int | None = None) -> None:
        """Touch every page of bytes ``[offset, offset + nbytes)`` of the arena now (default:
        all of it), so they are resident from the start: the process's peak RSS is then
        what was touched, not however many of its slots a run happened to have in use at
        once. Costs the page faults the slots would take when first used (about 65,536
        for 256 MiB), up front."""
        end = self.capacity if nbytes is None else min(self.capacity, offset + nbytes)
        with self._cond:
            if self._closed:
                raise UsageError("buffer pool is closed")
            view = self._view
            for page in range(offset // ALIGN * ALIGN, end, ALIGN):
                view[page] = 0

    # -- allocation ---------------------------------------------------------------------
    def try_acquire(self, nbytes: int, *, reserve: int = 0,
                    top: bool = False) -> PooledBuffer | None:
        """A buffer of ``nbytes`` if it fits now, else None. Never waits.

        ``reserve``: hold at least this many bytes for it (a streamed bucket takes a whole
        bucket's slot, however short, so that equal slots never fragment the pool);
        ``top``: carve it from the top of the arena (memory kept for the pool's life).
        See io/extents.py.
        """
        self._need(nbytes)  # refuses a negative or oversized request as it is
        need = self._need(max(nbytes, reserve))
        with self._cond:
            return self._take(nbytes, need, top)

    def acquire(self, nbytes: int, timeout: float | None = 30.0, *,
                reserve: int = 0) -> PooledBuffer:
        """A buffer of ``nbytes`` bytes, waiting up to ``timeout`` seconds for space.

        ``reserve``: hold at least this many bytes for it (as ``try_acquire``: buffers of
        one reserved size never fragment the pool, so first fit reuses the lowest slots).
        Raises RequestTooLargeError at once if ``nbytes`` exceeds the whole budget, and
        PoolExhaustedError when the wait times out.
        """
        self._need(nbytes)  # refuses a negative or oversized request as it is
        need = self._need(max(nbytes, reserve))
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                buf = self._take(nbytes, need)
                if buf is not None:
                    return buf
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise PoolExhaustedError(
                        f"buffer pool exhausted: waited {timeout:.1f} s for {need} bytes; "
                        f"{self.in_use} of {self.capacity} bytes are held by "
                        f"{self.live_buffers} unreleased buffers (largest free extent "
                        f"{self._extents.largest_free} bytes). Release buffers sooner "
                        f"or raise the pinned budget.")
                self._cond.wait(remaining)

    def _need(self, nbytes: int) -> int:
        if nbytes < 0:
            raise InputError(f"negative request: {nbytes} bytes")
        need = max(round_up(nbytes), ALIGN)
        if need > self.capacity:
            raise RequestTooLargeError(
                f"request of {nbytes} bytes can never fit in the buffer pool's budget of "
                f"{self.capacity} bytes")
        if self._closed:
            raise UsageError("buffer pool is closed")
        return need

    def _take(self, nbytes: int, need: int, top: bool = False) -> PooledBuffer | None:
        offset = self._extents.take(need, top)
        return None if offset is None else PooledBuffer(self, offset, nbytes, need)

    def release(self, buf: PooledBuffer) -> None:
        """Return ``buf``'s extent to the free list, merging with its neighbours."""
        if buf.pool is not self:
            raise InputError("buffer belongs to another pool")
        with self._cond:
            if buf._released:
                raise UsageError(f"{buf!r} released twice")
            buf._released = True
            self._extents.give(buf.offset, buf.capacity)
            self._cond.notify_all()

    @property
    def in_use(self) -> int:
        """Bytes held by unreleased buffers (multiples of 4096)."""
        return self._extents.in_use

    @property
    def peak_in_use(self) -> int:
        return self._extents.peak_in_use

    @property
    def live_buffers(self) -> int:
        return self._extents.live

    def reset_peak(self) -> None:
        with self._cond:
            self._extents.peak_in_use = self._extents.in_use

    def close(self) -> None:
        """Unpin and unmap the arena. Buffers still held become invalid."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._unpin()
        self._view.release()
        self._tensor = None
        try:
            self._mmap.close()
        except BufferError:
            # a tensor view is still referenced somewhere; the OS unmaps at process exit
            log.debug("buffer pool arena still referenced at close; left mapped")

    def __enter__(self) -> "BufferPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _cuda_host_unregister(address: int) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(address)
