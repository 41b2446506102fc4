"""One rank's part of a checkpoint generation, written while training goes on.

Two kinds of array, two sources:

- **State arrays** ``rank{r}/<key>[.<dtype>]`` are copies of the optimizer's store arrays,
  element for element, chunk ``i`` = store bucket ``i``. The store's ``snapshot`` hands each
  bucket to ``sink`` once, as it was when the save began (a bucket the next step wants
  first is copied by that step's ``acquire`` before it is changed). The bytes go from the
  pinned buffer to the file with no copy; their crc32c is taken from memory.
- **Parameter arrays** ``rank{r}/param[.<dtype>]`` pack this rank's rows of each parameter
  back to back. ``write_params`` copies them from the live parameters (CPU or GPU) into
  four 8 MiB page-aligned staging blocks written whole with O_DIRECT (staged_writer.py);
  the next optimizer step waits for it (a step pre-hook), so nothing changes them meanwhile.

Memory beyond the store's pinned pool: those 32 MiB (and as much again for GPU-homed state
arrays, only where there are some).
"""

from __future__ import annotations

import os
import threading

import torch

from ..io import AsyncFileIO
from ..io.page_cache import sync_tree
from ..layout import FlatArray
from .. import dtypes
from ..layout.manifest import rank_group, rank_metadata_files
from ..layout.metadata_crc import files_crc32c
from ..layout.checksums import SequentialChunkCrc, padded_crc32c
from .staged_writer import StagedWriter, StagingBlocks


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8)


class RankWriter:
    """Writes rank ``rank``'s arrays of one generation under ``staging``.

    Args:
        param_arrays: ``{array name: (dtype, numel)}`` of the packed parameter arrays.
        params: ``[(label, source, array name, first element)]``: ``source()`` gives the
            tensor whose bytes go there (a live parameter shard, or a buffer's copy).
        state_arrays: ``{store array name: (array name, dtype, numel, chunk bytes)}``.
        chunk_bytes: chunk size of parameter arrays (bytes).
    """

    def __init__(self, staging: str, rank: int, param_arrays: dict, params: list,
                 state_arrays: dict, chunk_bytes: int):
        self.staging = staging
        self.rank = rank
        self.params = params
        self.io = AsyncFileIO(threads=4, queue_depth=8)
        self.arrays: dict[str, FlatArray] = {}          # every array, by name in the generation
        self.state_by_store: dict[str, FlatArray] = {}  # state arrays, by store array name
        self.names: dict[str, str] = {}                 # store array name -> name here
        self.checksums: dict[str, list[int | None]] = {}
        self.bytes_written = 0
        self._lock = threading.Lock()
        self._param_staging: StagingBlocks | None = None   # used by write_params' thread
        self._gpu_staging: StagingBlocks | None = None     # used by sink, under _gpu_lock
        # sink runs on the snapshot's worker thread and, for a bucket the next step acquires
        # first, on the training thread at the same time: for GPU-homed state both would fill
        # the one set of staging blocks. One lock over their creation and use, rather than
        # blocks per thread: the memory stays 32 MiB, and the training thread waits at most
        # for one bucket the worker is writing (it would write one of its own anyway).
        self._gpu_lock = threading.Lock()
        try:
            for name, (dtype, numel) in param_arrays.items():
                self.arrays[name] = self._create(name, numel, dtype, chunk_bytes)
            for store_name, (name, dtype, numel, bucket_bytes) in state_arrays.items():
                arr = self.arrays[name] = self._create(name, numel, dtype, bucket_bytes)
                self.state_by_store[store_name] = arr
                self.names[store_name] = name
                self.checksums[name] = [None] * arr.nchunks
        except BaseException:
            self.io.close()
            raise
        self.param_crcs = {name: SequentialChunkCrc(self.arrays[name].chunk_bytes,
                                                    self.arrays[name].numel * self.arrays[name].itemsize)
                           for name in param_arrays}

    def _create(self, name: str, numel: int, dtype: torch.dtype, chunk_bytes: int) -> FlatArray:
        return FlatArray.create(os.path.join(self.staging, name), numel, dtype, io=self.io,
                                chunk_bytes=chunk_bytes,
                                dimension_name=FlatArray.dimension_for(name))

    # -- state: the store's snapshot calls this once per bucket -------------------------------
    def sink(self, store_name: str, index: int, start: int, tensor: torch.Tensor) -> None:
        """Write store bucket ``index`` of ``store_name`` (elements from ``start``) to its
        chunk and record the chunk's crc32c; returns when the bytes are on the device."""
        arr = self.state_by_store[store_name]
        n = tensor.numel()
        chunk = start // arr.chunk_elems
        if start % arr.chunk_elems or (n and (start + n - 1) // arr.chunk_elems != chunk):
            raise AssertionError(f"{arr.path}: bucket {index} [{start}, {start + n}) is not "
                                 f"one chunk of {arr.chunk_elems} elements")
        if tensor.device.type == "cpu":  # a pooled (page-aligned) buffer: written as it is
            # O_DIRECT but for a sub-page tail, which AsyncFileIO sends through the page cache
            future = arr.write_from(start, start + n, tensor)
            crc = padded_crc32c(as_bytes(tensor), arr.chunk_bytes)  # while the write runs
            future.result()
        else:  # a GPU-homed array: through the staging blocks, one thread at a time
            with self._gpu_lock:
                if self._gpu_staging is None:
                    self._gpu_staging = StagingBlocks()
                crcs = SequentialChunkCrc(arr.chunk_bytes, n * arr.itemsize)
                writer = StagedWriter(arr, self._gpu_staging, crcs, start=start * arr.itemsize)
                writer.add([tensor])
                writer.finish()
            crc = crcs.finish()[0]
        with self._lock:
            self.checksums[self.names[store_name]][chunk] = crc
            self.bytes_written += n * arr.itemsize

    # -- parameters -------------------------------------------------------------------------
    @torch.no_grad()
    def write_params(self) -> None:
        """Write this rank's rows of every parameter (and rank 0's buffers), packed, through
        page-aligned staging blocks: one array at a time, in element order, so the chunk
        checksums are taken as the bytes go out."""
        by_array: dict[str, list] = {}
        for entry in sorted(self.params, key=lambda e: (e[2], e[3])):
            by_array.setdefault(entry[2], []).append(entry)
        for name, entries in by_array.items():
            arr = self.arrays[name]
            if self._param_staging is None:
                self._param_staging = StagingBlocks()
            writer = StagedWriter(arr, self._param_staging, self.param_crcs[name])
            at = 0
            for label, source, _, offset in entries:
                if offset != at:
                    raise AssertionError(f"{arr.path}: {label} planned at element {offset}, "
                                         f"the packed stream is at element {at}")
                tensor = source()
                # one at a time: a non-contiguous tensor's copy lives only until written
                writer.add([tensor if tensor.is_contiguous() else tensor.contiguous()])
                at += tensor.numel()
            writer.finish()  # the staging blocks go to the next array
            self.bytes_written += at * arr.itemsize

    # -- the end ------------------------------------------------------------------------------
    def finish(self) -> dict:
        """fsync everything this rank wrote; its summary for rank 0 (array dtypes and
        sizes, chunk checksums, and the crc32c of its metadata files: its shard table and
        its arrays' zarr.json, as they are on disk)."""
        for name, crc in self.param_crcs.items():
            self.checksums[name] = crc.finish()
        missing = [(n, i) for n, c in self.checksums.items() for i, v in enumerate(c) if v is None]
        if missing:
            raise AssertionError(f"{self.staging}: chunks never written: {missing[:4]}")
        self.close()
        sync_tree(os.path.join(self.staging, rank_group(self.rank)))
        return {"checksums": self.checksums,
                "arrays": {n: {"dtype": dtypes.dtype(a.dtype).name, "numel": a.numel}
                           for n, a in self.arrays.items()},
                "metadata_checksums": files_crc32c(
                    self.staging, rank_metadata_files(self.rank, self.arrays))}

    def close(self) -> None:
        """Stop the I/O threads and free the staging blocks (after a failure too)."""
        self.io.close()
        with self._gpu_lock:  # not while a sink still fills them
            for staging in (self._param_staging, self._gpu_staging):
                if staging is not None:
                    staging.close()
            self._param_staging = self._gpu_staging = None

