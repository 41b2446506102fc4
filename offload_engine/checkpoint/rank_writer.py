"""One rank's part of a checkpoint generation, written while training goes on.

Two kinds of array, two sources:

- **State arrays** ``rank{r}/<key>[.<dtype>]`` are copies of the optimizer's store arrays,
  element for element, chunk ``i`` = store bucket ``i``. The store's ``snapshot`` hands each
  bucket to ``sink`` once, as it was when the save began (a bucket the next step wants
  first is copied by that step's ``acquire`` before it is changed). The bytes go from the
  pinned buffer to the file with no copy; their crc32c is taken from memory.
- **Parameter arrays** ``rank{r}/param[.<dtype>]`` pack this rank's rows of each parameter
  back to back. ``write_params`` reads them from the live parameters, one at a time (a
  GPU parameter goes through one 64 MiB staging buffer); the next
  optimizer step waits for it (a step pre-hook), so nothing changes them meanwhile.

Memory beyond the store's pinned pool: that staging buffer where CUDA is used, else none.
"""

from __future__ import annotations

import os
import threading

import torch

from ..io import AsyncFileIO, IOFuture
from ..io.page_cache import sync_tree
from ..layout import FlatArray
from ..layout.dtypes import torch_to_zarr
from ..layout.manifest import rank_group
from ..optim.state_access import local_param
from .checksums import SequentialChunkCrc, crc32c_extend, crc32c_extend_zeros, padded_crc32c

IN_FLIGHT = 8             # parameter writes queued at once (each at most one chunk)
STAGE_BYTES = 64 << 20    # the GPU -> CPU staging buffer (bytes)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8)


class RankWriter:
    """Writes rank ``rank``'s arrays of one generation under ``staging``.

    Args:
        param_arrays: ``{array name: (dtype, numel)}`` of the packed parameter arrays.
        params: ``[(ParamInfo, array name, first element)]`` in element order per array.
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
        self._staging_buf: torch.Tensor | None = None
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
                                chunk_bytes=chunk_bytes)

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
        if tensor.device.type == "cpu":
            arr.write_from(start, start + n, tensor).result()
            crc = padded_crc32c(as_bytes(tensor), arr.chunk_bytes)
        else:  # a GPU-homed array: through the staging buffer, a piece at a time
            crc, step = 0, STAGE_BYTES // arr.itemsize
            for lo in range(0, n, step):
                part = self._stage(tensor[lo:lo + step])
                arr.write_from(start + lo, start + lo + part.numel(), part).result()
                crc = crc32c_extend(crc, as_bytes(part))
            crc = crc32c_extend_zeros(crc, arr.chunk_bytes - n * arr.itemsize)
        with self._lock:
            self.checksums[self.names[store_name]][chunk] = crc
            self.bytes_written += n * arr.itemsize

    # -- parameters -------------------------------------------------------------------------
    @torch.no_grad()
    def write_params(self) -> None:
        """Write this rank's rows of every parameter, in element order (so the chunk
        checksums are taken as the bytes go out)."""
        pending: list[tuple[IOFuture, torch.Tensor]] = []  # a source lives until written
        for info, name, offset in self.params:
            arr = self.arrays[name]
            flat = local_param(info).detach().reshape(-1)
            step = STAGE_BYTES // arr.itemsize
            for lo in range(0, flat.numel(), step):
                part = flat[lo:lo + step]
                if part.device.type != "cpu" or not part.is_contiguous():
                    while pending:  # the staging buffer is reused: drain first
                        pending.pop(0)[0].result()
                    part = self._stage(part)
                self.param_crcs[name].add(as_bytes(part))
                pending.append((arr.write_from(offset + lo, offset + lo + part.numel(), part), part))
                while len(pending) > IN_FLIGHT:
                    pending.pop(0)[0].result()
            self.bytes_written += flat.numel() * arr.itemsize
        for f, _ in pending:
            f.result()

    def _stage(self, part: torch.Tensor) -> torch.Tensor:
        """``part`` copied into the reusable CPU staging buffer (pinned where CUDA exists)."""
        nbytes = part.numel() * part.element_size()
        if self._staging_buf is None or self._staging_buf.numel() < nbytes:
            pin = torch.cuda.is_available()
            self._staging_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        out = self._staging_buf[:nbytes].view(part.dtype)
        out.copy_(part.reshape(-1))
        if part.device.type == "cuda":
            torch.cuda.current_stream(part.device).synchronize()
        return out

    # -- the end ------------------------------------------------------------------------------
    def finish(self) -> dict:
        """fsync everything this rank wrote; its summary for rank 0 (array dtypes and
        sizes, chunk checksums)."""
        for name, crc in self.param_crcs.items():
            self.checksums[name] = crc.finish()
        missing = [(n, i) for n, c in self.checksums.items() for i, v in enumerate(c) if v is None]
        if missing:
            raise AssertionError(f"{self.staging}: chunks never written: {missing[:4]}")
        self.io.close()
        sync_tree(os.path.join(self.staging, rank_group(self.rank)))
        return {"checksums": self.checksums,
                "arrays": {n: {"dtype": torch_to_zarr(a.dtype), "numel": a.numel}
                           for n, a in self.arrays.items()}}

    def close(self) -> None:
        self.io.close()

