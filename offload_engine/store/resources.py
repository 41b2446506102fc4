"""What a store holds open, opened onto one ExitStack in the order its close undoes them.

Opening: the write lock of every NVMe directory, the pinned pool, the store's completion
thread (``oe-store``), the file I/O threads with their settings, and with a GPU tier its
copy waiter thread (``oe-copy-wait``) and arena. The stack undoes them in reverse: when a
later step of opening fails (exactly what was opened so far), and at ``close()``: the copy
waiter ends first (after the flush no write-back waits for a copy), then every I/O (each
posts its completion), then the store's thread (it handles what was posted), then the pool
and the locks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from dataclasses import dataclass

import torch

from ..errors import InputError
from ..io import AsyncFileIO, BufferPool, FileIOError, syscalls
from . import io_choice
from .completions import CompletionQueue
from .config import StoreConfig
from .lock import WriteLock

log = logging.getLogger(__name__)

_THREAD_JOIN_S = 60  # seconds a close waits for each of the store's threads to end


@dataclass
class StoreResources:
    locks: list                         # WriteLock per NVMe directory
    pool: BufferPool
    completions: CompletionQueue        # oe-store
    io: AsyncFileIO
    io_settings: io_choice.IOSettings
    copy_waiter: CompletionQueue | None  # oe-copy-wait, with a GPU tier only
    gpu: object | None                  # GpuStaging, with a GPU tier only


def open_resources(stack: contextlib.ExitStack, config: StoreConfig, root: str | None,
                   stripes: list[str], owner, counters, gpu_device=None) -> StoreResources:
    """Open a store's resources onto ``stack`` (which undoes them, in reverse).

    Args:
        root: the store group's directory (the first of ``stripes``), or None.
        stripes: the NVMe directories, absolute; each is made if missing and locked.
        owner: the store: its threads also end when it is dropped without a close.
        counters: the store's StatsCounter (the GPU tier counts its copies there).
        gpu_device: the GPU tier's device operations; default CUDA's, when available.
            No GPU tier without ``gpu_budget``, or without either.
    """
    for d in stripes:
        try:
            syscalls.makedirs(d, exist_ok=True)
        except OSError as e:
            raise FileIOError(e.errno, "mkdir", d) from e
    check_distinct_directories(config.nvme_paths, stripes)
    locks = []
    for d in stripes:
        lock = WriteLock(d)
        stack.callback(lock.release)
        locks.append(lock)
    pool = BufferPool(config.cpu_budget)
    stack.callback(pool.close)
    completions = _own_thread(stack, owner, "oe-store")
    # per direction: the config's fields where set, else the device profile's
    choice = io_choice.resolve(config, root)
    io = AsyncFileIO(threads=choice["threads"], read=choice["read"], write=choice["write"])
    stack.callback(io.close)
    settings = io_choice.IOSettings(io, choice["report"], choice["controllers"])
    copy_waiter = gpu = None
    if config.gpu_budget and (gpu_device is not None or torch.cuda.is_available()):
        from .gpu_staging import CudaDevice, GpuStaging
        copy_waiter = _own_thread(stack, owner, "oe-copy-wait")
        gpu = GpuStaging(config.gpu_budget, gpu_device or CudaDevice(), counters, copy_waiter,
                         slot_bytes=config.bucket_bytes)
    return StoreResources(locks, pool, completions, io, settings, copy_waiter, gpu)


def check_distinct_directories(entries: list[str], paths: list[str]) -> None:
    """Refuse (InputError) two ``nvme_paths`` entries that are one directory: the same
    device and inode, however written (``a`` and ``a/``, ``a/../a``, a symbolic link to
    it). Checked before any lock is taken: the second lock of one directory would be
    refused by the first, reporting this very process as the holder. ``entries`` as the
    config gives them (for the message), ``paths`` the same made absolute."""
    seen: dict[tuple[int, int], int] = {}
    for i, path in enumerate(paths):
        try:
            st = os.stat(path)
        except OSError as e:
            raise FileIOError(e.errno, "stat", path) from e
        first = seen.setdefault((st.st_dev, st.st_ino), i)
        if first != i:
            raise InputError(
                f"nvme_paths lists one directory twice: entry {first} ({entries[first]!r}) and "
                f"entry {i} ({entries[i]!r}) are both {os.path.realpath(path)}; list each "
                f"directory once (buckets are striped over distinct directories)")


def _own_thread(stack: contextlib.ExitStack, owner, name: str) -> CompletionQueue:
    """A CompletionQueue thread ``name`` that ``stack`` closes, and that also ends when
    ``owner`` is dropped without a close (nothing may wait forever)."""
    queue = CompletionQueue(name)
    stop_if_dropped = weakref.finalize(owner, queue.stop)

    def close() -> None:
        if not queue.close(_THREAD_JOIN_S):
            log.warning("store close: thread %s did not end within %d s", name, _THREAD_JOIN_S)
        stop_if_dropped.detach()

    stack.callback(close)
    return queue
