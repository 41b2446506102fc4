"""Write stores and checkpoints in the documented format (docs/format.md, "Manifest") from
tensors in memory: for tests, benchmarks and examples, until the optimizer and the
checkpoint writer produce them.

Layout: every state ``s`` of rank ``r`` is one array ``rank{r}/{s}`` (``rank{r}/{s}_<dtype>``
for states not in float32, as the optimizer names them); each tensor is split
into FSDP2 ``Shard(0)`` row blocks (``ceil(rows / world_size)`` rows per rank, the last
ranks short or empty) and each rank's block of each state is appended to that rank's
array. A checkpoint generation adds ``committed`` and the crc32c of every chunk file, and
the checkpoint folder gets a ``latest`` file naming it.
"""

from __future__ import annotations

import math
import os

import torch

from offload_engine.io import AsyncFileIO
from offload_engine.layout import FlatArray, create_group, torch_to_zarr, write_group_attributes

from .checksums import crc32c
from .manifest import FORMATS

MiB = 1 << 20


def row_blocks(rows: int, world_size: int) -> list[tuple[int, int]]:
    """(row_start, rows) per rank, as ``torch.chunk`` splits rows (FSDP2 Shard(0))."""
    per = -(-rows // world_size) if rows else 0
    out = []
    for r in range(world_size):
        lo = min(rows, r * per)
        out.append((lo, min(rows, lo + per) - lo))
    return out


def plan_sharded(tensors: dict, world_size: int) -> tuple[dict, dict, list]:
    """Lay ``tensors`` out over ``world_size`` ranks (see ``write_sharded``).

    Returns ``(arrays, entries, writes)``: ``arrays`` {array: {"dtype", "numel"}} for the
    manifest, ``entries`` the manifest's ``tensors``, ``writes`` [(array, offset, values)]
    for the states given as tensors.
    """
    arrays: dict[str, dict] = {}
    cursors: dict[str, int] = {}
    entries = {}
    writes = []
    for name, spec in tensors.items():
        shape = list(spec["shape"])
        rows = shape[0] if shape else 1
        row_numel = math.prod(shape[1:])
        shards = []
        for r, (row_start, nrows) in enumerate(row_blocks(rows, world_size)):
            numel = nrows * row_numel
            states = {}
            for state, value in spec["states"].items():
                dtype = value.dtype if isinstance(value, torch.Tensor) else value
                zdtype = torch_to_zarr(dtype)
                array = f"rank{r}/{state}" + ("" if zdtype == "float32" else f"_{zdtype}")
                arrays.setdefault(array, {"dtype": zdtype, "numel": 0})
                offset = cursors.get(array, 0)
                cursors[array] = offset + numel
                states[state] = {"array": array, "offset": offset}
                if isinstance(value, torch.Tensor) and numel:
                    flat = value.reshape(-1)
                    writes.append((array, offset,
                                   flat[row_start * row_numel:row_start * row_numel + numel]))
            shards.append({"rank": r, "row_start": row_start, "rows": nrows, "numel": numel,
                           "states": states})
        entries[name] = {"shape": shape, "dtype": torch_to_zarr(spec["dtype"]),
                         "optimizer": spec.get("optimizer"), "shards": shards}
    for array, n in cursors.items():
        arrays[array]["numel"] = n
    return arrays, entries, writes


def write_sharded(group: str, tensors: dict, world_size: int, *, kind: str = "checkpoint",
                  step: int = 0, chunk_bytes: int = 64 * MiB, data: bool = True,
                  io: AsyncFileIO | None = None) -> dict:
    """Write a store directory or one checkpoint generation at ``group``.

    ``tensors``: ``{name: {"shape": [...], "dtype": torch dtype of the parameter,
    "optimizer": "muon" | "adamw" | None, "states": {state: tensor or torch dtype}}}``.
    A state given as a tensor (the full, unsharded value) is written; given as a dtype,
    only the manifest and array metadata are (``data=False`` does this for all: chunk
    files absent, reading as zeros). Returns the manifest written.
    """
    own_io = io is None
    io = io or AsyncFileIO(threads=4, queue_depth=4)
    try:
        arrays, entries, writes = plan_sharded(tensors, world_size)
        if kind == "store":
            for meta in arrays.values():
                size = torch.empty((), dtype=_dtype(meta["dtype"])).element_size()
                meta.update(home="nvme", bucket_elems=chunk_bytes // size)
        create_group(group, {"format": FORMATS[kind], "format_version": 1, "arrays": {}},
                     exist_ok=True)
        flats = {a: FlatArray.create(os.path.join(group, a), m["numel"], _dtype(m["dtype"]),
                                     io=io, chunk_bytes=chunk_bytes, overwrite=True)
                 for a, m in arrays.items()}
        if data:
            for array, offset, values in writes:
                flats[array].write(offset, values.to(flats[array].dtype).contiguous())
        manifest = {"format": FORMATS[kind], "format_version": 1, "arrays": arrays,
                    "world_size": world_size, "step": step, "tensors": entries}
        if kind == "checkpoint":
            for flat in flats.values():
                flat.sync().result()
            manifest["checksums"] = {a: chunk_checksums(f) for a, f in flats.items()}
            manifest["committed"] = True
        write_group_attributes(group, manifest)
        return manifest
    finally:
        if own_io:
            io.close()


def chunk_checksums(flat: FlatArray) -> list[int | None]:
    """crc32c of every chunk file of ``flat`` (None for a chunk file that is absent)."""
    out = []
    for i in range(flat.nchunks):
        path = flat.chunk_path(i)
        if not os.path.exists(path):
            out.append(None)
            continue
        with open(path, "rb") as f:
            out.append(crc32c(f.read()))
    return out


def write_checkpoint(root: str, tensors: dict, world_size: int, step: int,
                     generation: str | None = None, **options) -> str:
    """A checkpoint folder: generation ``generation`` (default ``step-<step>``) and a
    ``latest`` file naming it. Returns the generation's path."""
    generation = generation or f"step-{step:08d}"
    group = os.path.join(root, generation)
    write_sharded(group, tensors, world_size, kind="checkpoint", step=step, **options)
    with open(os.path.join(root, "latest"), "w", encoding="utf-8") as f:
        f.write(generation + "\n")
    return group


def _dtype(name: str) -> torch.dtype:
    from offload_engine.layout import zarr_to_torch
    return zarr_to_torch(name)
