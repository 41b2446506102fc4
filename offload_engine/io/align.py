"""Alignment arithmetic and page-aligned host memory.

O_DIRECT needs the buffer address, the file offset and the length to be multiples of the
device's logical block size; 4096 bytes covers every device we target. ``torch.empty`` only
guarantees 64-byte alignment, so aligned memory comes from an anonymous ``mmap``.

torch is not imported here (it takes over a second, longer than some whole commands that
use this package): functions that hand out tensors import it, and ``as_byte_view`` asks
``sys.modules`` whether a buffer can be a tensor at all.
"""

from __future__ import annotations

import mmap
import sys

from ..envflags import env_flag
from ..units import MiB, PAGE
from ..errors import InputError

ALIGN = PAGE  # bytes: O_DIRECT alignment of addresses, offsets and lengths
HUGE_PAGE = 2 * MiB  # bytes: an x86-64 / arm64 (4 KiB granule) transparent huge page
HUGE_PAGES_ENV = "OFFLOAD_ENGINE_HUGE_PAGES"  # off: host buffers of ordinary pages only


def round_up(nbytes: int, align: int = ALIGN) -> int:
    """Smallest multiple of ``align`` that is >= ``nbytes`` (bytes)."""
    return -(-nbytes // align) * align


def is_aligned(value: int, align: int = ALIGN) -> bool:
    return value % align == 0


def aligned_host_region(nbytes: int) -> mmap.mmap:
    """``nbytes`` (rounded up to a page, at least one) of page-aligned anonymous memory.
    Pages are committed lazily by the kernel on first touch.

    Regions of at least ``HUGE_PAGE`` bytes are rounded up to whole huge pages and asked
    for transparent huge pages (``MADV_HUGEPAGE``; ``huge_pages_wanted``), because an
    O_DIRECT request is cut into one device request per ``max_segments`` physically
    contiguous runs of its buffer: from 4 KiB pages a 4 MiB read reached this VM's virtio
    disk as 512 KiB requests and moved 0.75-0.80 GB/s, from huge pages as one 4 MiB request
    at 1.38-1.88 GB/s (16 streams, 4 GiB, 2026-12-02; docs/store.md, "Huge pages"). Where
    the kernel has none to give, the region is ordinary pages, as before."""
    size = max(round_up(nbytes), ALIGN)
    huge = size >= HUGE_PAGE and huge_pages_wanted()
    # a whole number of huge pages: Linux places such anonymous mappings on a huge-page
    # boundary, so every 2 MiB of the region can be one huge page
    region = mmap.mmap(-1, round_up(size, HUGE_PAGE) if huge else size,
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without THP: ordinary pages
            pass
    return region


def huge_pages_wanted() -> bool:
    """Whether host buffers ask for transparent huge pages: yes unless
    ``OFFLOAD_ENGINE_HUGE_PAGES`` is 0/false/no/off (to measure without them, or where a
    site's kernel policy asks for it); another spelling is refused (``envflags``)."""
    return env_flag(HUGE_PAGES_ENV, True) and hasattr(mmap, "MADV_HUGEPAGE")


def aligned_host_buffer(nbytes: int):
    """Allocate ``nbytes`` (rounded up to a page) of page-aligned host memory.

    Returns the mmap (keep it alive as long as the tensor) and a uint8 torch tensor over
    it (torch is imported here).
    """
    import torch

    region = aligned_host_region(nbytes)
    tensor = torch.frombuffer(region, dtype=torch.uint8)
    assert tensor.data_ptr() % ALIGN == 0  # mmap returns page-aligned memory by definition
    return region, tensor


def as_byte_view(buffer) -> memoryview:
    """A writable, flat, byte-typed memoryview over ``buffer`` without copying.

    Accepts a contiguous CPU torch tensor (any dtype, bfloat16 included), a numpy array
    (any dtype, ml_dtypes' bfloat16 included), bytearray, mmap or memoryview.
    """
    # A process that never imported torch (numpy) holds no tensor (array): no import here.
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    if torch is not None and isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu":
            raise InputError(f"file I/O needs a CPU tensor, got one on {buffer.device}")
        if not buffer.is_contiguous():
            raise InputError("file I/O needs a contiguous tensor")
        flat = buffer.reshape(-1)
        if flat.numel() == 0:
            return memoryview(bytearray(0))
        return memoryview(flat.view(torch.uint8).numpy()).cast("B")
    if np is not None and isinstance(buffer, np.ndarray):
        # bytes first: numpy cannot export ml_dtypes' types (bfloat16) through the buffer protocol
        if not buffer.flags.c_contiguous:
            raise InputError("file I/O needs a contiguous array")
        return memoryview(buffer.reshape(-1).view(np.uint8))
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise InputError("file I/O needs a contiguous buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def address_of(view: memoryview) -> int:
    """Start address of a memoryview's memory (for alignment checks)."""
    import ctypes

    if len(view) == 0:
        return 0
    if view.readonly:
        # ctypes.from_buffer needs a writable buffer; a read-only view is written from
        # only, and a buffered write has no alignment need, so report "unaligned".
        return 1
    return ctypes.addressof(ctypes.c_char.from_buffer(view))
