"""GPU memory for state: one preallocated arena and a side stream for host<->device copies.

Copies run on the side stream and are ordered with the compute stream by events, so the
host never blocks: the compute stream waits for a copy-in on the GPU, and a copy-out is
awaited (``event.synchronize()``) only by the I/O thread that writes the bytes to disk.
Only constructed when ``torch.cuda.is_available()``.
"""

from __future__ import annotations

import torch

from ..io.extents import Extents
from ..io.align import round_up


class GpuTier:
    """``budget_bytes`` of device memory carved into extents (bytes, 4096-aligned)."""

    def __init__(self, budget_bytes: int, device: torch.device | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("the gpu tier needs CUDA, which is not available")
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.capacity = round_up(budget_bytes)
        self.arena = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        self.extents = Extents(self.capacity)
        self.stream = torch.cuda.Stream(self.device)

    def alloc(self, nbytes: int) -> int | None:
        """Offset of ``nbytes`` (rounded to 4096) of free device memory, or None."""
        return self.extents.take(round_up(max(nbytes, 1)))

    def free(self, offset: int, nbytes: int) -> None:
        self.extents.give(offset, round_up(max(nbytes, 1)))

    def view(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return self.arena[offset:offset + nbytes].view(dtype)

    def copy_in(self, dst: torch.Tensor, src_pinned: torch.Tensor) -> None:
        """Host -> device on the side stream; the current stream waits for it on the GPU."""
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # dst may still be read by earlier kernels
        with torch.cuda.stream(self.stream):
            dst.copy_(src_pinned, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        compute.wait_event(done)

    def copy_out(self, dst_pinned: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
        """Device -> host on the side stream after the compute stream's pending work;
        returns the event that marks the host bytes valid."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst_pinned.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    @property
    def in_use(self) -> int:
        return self.extents.in_use

    @property
    def peak_in_use(self) -> int:
        return self.extents.peak_in_use
