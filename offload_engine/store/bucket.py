"""A bucket: a contiguous element range of one flat array, the unit of residency; and the
handle that lends a range of one to a user."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InputError

ABSENT = "absent"      # only on its home tier (disk, or never touched)
READING = "reading"    # a read into a pinned buffer is in flight
RESIDENT = "resident"  # bytes valid in the pinned buffer
WRITING = "writing"    # write-back to disk in flight; bytes still valid in the buffer


@dataclass(eq=False)
class Bucket:
    array: Any            # the StoreArray it belongs to (store/registry.py)
    index: int
    start: int            # first element
    stop: int             # one past the last element
    nbytes: int
    state: str = ABSENT
    buf: Any = None       # PooledBuffer while resident, reading or writing
    gpu_offset: int | None = None  # extent in the GPU arena (gpu home, or staged for a user)
    refs: int = 0
    keeps: int = 0        # of refs, those held by keep() handles (no bytes lent)
    dirty: bool = False   # holds bytes newer than the home tier's
    on_disk: bool = False
    write_failed: bool = False
    error: BaseException | None = None
    last_use: int = 0
    d2h_event: Any = None  # torch.cuda.Event guarding buf after a copy from the GPU
    h2d_event: Any = None  # torch.cuda.Event: a copy from buf to the GPU has read it
    pinned_home: bool = False  # cpu/gpu home: never evicted
    gpu_users: int = 0
    saving: bool | int = False  # being copied for a snapshot (by its thread: True; by an
    # acquire: that thread's id): users wait before changing it
    io_since: float = 0.0  # time.monotonic() when its read or write-back started

    @property
    def key(self) -> tuple[str, int]:
        return (self.array.name, self.index)

    def host_view(self, dtype: torch.dtype) -> torch.Tensor:
        return self.buf.view(dtype, self.stop - self.start)


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


def check_acquire_device(dev: torch.device, name: str, home: str, has_gpu_tier: bool) -> None:
    """Refuse (InputError) lending array ``name`` (homed on ``home``) on ``dev``: only the
    CPU or a CUDA device, CUDA only with a gpu tier, a GPU-home array only on CUDA."""
    if dev.type == "cuda" and not has_gpu_tier and not torch.cuda.is_available():
        raise InputError(f"acquire on {dev}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"acquire on {dev}: only 'cpu' and CUDA devices are supported")
    if dev.type == "cuda" and not has_gpu_tier:
        raise InputError(f"acquire of {name} on {dev}: the store has no gpu tier (gpu_budget is 0)")
    if home == "gpu" and dev.type != "cuda":
        raise InputError(f"array {name} lives on the GPU; acquire it with a CUDA device")
