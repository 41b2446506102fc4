"""Our checkpoints as a consolidation source: each parameter reassembled from its row
blocks (the ranks' shard tables, read on the first read) with every chunk read verified
against its crc32c.

Arrays are read through ``layout.FlatArray``, which imports zarr and torch: imported when
the first array is opened, so that the command line, which imports this module for
``is_our_checkpoint``, does not pay for them on DeepSpeed checkpoints.
"""

from __future__ import annotations

import math
import os

from ..io import AsyncFileIO
from ..io.align import as_byte_view
from .checksums import ChunkVerifier
from .consolidate import TensorInfo
from .dtypes import as_dtype
from .generations import CheckpointError, manifest, resolve, shard_tables


def is_our_checkpoint(path: str) -> bool:
    """Whether ``path`` is one of our checkpoint directories (or one generation of one)."""
    if os.path.isfile(os.path.join(path, "latest")):
        try:
            with open(os.path.join(path, "latest")) as f:
                path = os.path.join(path, f.read().strip())
        except OSError:
            return False
    try:
        with open(os.path.join(path, "zarr.json")) as f:
            return '"offload-engine-checkpoint"' in f.read()
    except OSError:
        return False


class CheckpointSource:
    """The parameters of one generation (``latest`` or ``tag``), as full tensors by name."""

    def __init__(self, path: str, tag: str | None = None, exclude_frozen: bool = False):
        if os.path.isfile(os.path.join(path, "zarr.json")) and not os.path.isfile(
                os.path.join(path, "latest")):
            self.gen = path  # a generation directory given directly
            manifest(path)
        else:
            self.gen = resolve(path, tag)
        self.attrs = manifest(self.gen)
        self._io = AsyncFileIO(threads=4, queue_depth=4)
        self._arrays: dict = {}  # array name -> layout.FlatArray
        self._verifier = ChunkVerifier(self.gen, self.attrs["checksums"])
        self._infos = []
        for name in sorted(self.attrs["tensors"]):
            entry = self.attrs["tensors"][name]
            # zarr v3 data type names are the dtypes' numpy (and torch) names
            self._infos.append(TensorInfo(name, tuple(entry["shape"]), as_dtype(entry["dtype"])))
        self._shards: dict | None = None  # {name: [(rank, shard)]}, read when first needed
        # exclude_frozen: every parameter the optimizer saw had a gradient; nothing to drop

    def tensors(self) -> list[TensorInfo]:
        return list(self._infos)

    def aliases(self) -> dict[str, str]:
        return {}

    def describe(self) -> str:
        return (f"offload-engine checkpoint {self.gen} (step {self.attrs['step']}, world size "
                f"{self.attrs['world_size']})")

    def _array(self, name: str):
        from ..layout import FlatArray

        if name not in self._arrays:
            path = os.path.join(self.gen, name)
            try:
                self._arrays[name] = FlatArray.open(path, io=self._io, mode="r")
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{path}: cannot open: {e}") from None
        return self._arrays[name]

    def read(self, requests) -> None:
        """Fill each request's ``out`` with elements [start, start + len(out)) of the full tensor."""
        if self._shards is None:
            self._shards = shard_tables(self.gen, range(self.attrs["world_size"]))
        for req in requests:
            shape = self.attrs["tensors"][req.name]["shape"]
            row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
            lo, hi = req.start, req.start + len(req.out)
            dest = as_byte_view(req.out)
            futures = []
            for _, sh in self._shards.get(req.name, []):
                s_lo = sh["row_start"] * row_numel
                s_hi = s_lo + sh["numel"]
                a, b = max(lo, s_lo), min(hi, s_hi)
                if a >= b:
                    continue
                where = sh["states"]["param"]
                flat = self._array(where["array"])
                start = where["offset"] + (a - s_lo)
                self._verifier.verify(where["array"], flat, start, start + b - a)
                size = flat.itemsize
                futures.append(flat.read_into(start, start + b - a, dest[(a - lo) * size:(b - lo) * size]))
            for f in futures:
                f.result()

    def close(self) -> None:
        self._io.close()

    def __enter__(self) -> "CheckpointSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
