"""Write stores and checkpoints in the documented format (docs/format.md, "Manifest") from
tensors in memory: for tests, benchmarks and examples. The manifest goes through the same
helpers as ``checkpoint.save`` and the optimizer's store manifest (``layout.manifest``:
tensor entries, shard entries, shard tables; ``layout.checksums``: chunk checksums).

Layout: every state ``s`` of rank ``r`` is one array ``rank{r}/{s}`` (``rank{r}/{s}_<dtype>``
for states not in float32, as the optimizer names them); each tensor is split
into FSDP2 ``Shard(0)`` row blocks (``ceil(rows / world_size)`` rows per rank, the last
ranks short or empty) and each rank's block of each state is appended to that rank's
array. Rank r's shard table is the attributes of group ``rank{r}``. A checkpoint
generation adds ``committed`` and the crc32c of every chunk (null where absent), and the
checkpoint folder gets a ``latest`` file naming it.
"""

from __future__ import annotations

import json
import math
import os

import google_crc32c
from typing import NamedTuple

import torch

from offload_engine import dtypes
from offload_engine.io import AsyncFileIO
from offload_engine.layout import FlatArray, create_group
from offload_engine.formats.ours.tensor_table import FORMATS
from offload_engine.layout.manifest import (CHECKPOINT_VERSION, MANIFEST_VERSION,
                                            array_metadata_key, box_shard_entry, fsdp_rows,
                                            shard_entry,
                                            shard_table_key, tensor_entry, tensor_rows,
                                            write_shard_table)
from offload_engine.layout.metadata_crc import METADATA_KEY, files_crc32c
from offload_engine.units import MiB


# What a checkpoint records for an array, computed by reading its files back (the engine's
# writers checksum the bytes from memory as they write them): a test's independent check.
PIECE = 8 << 20


def file_crc32c(path: str) -> int:
    """CRC-32C of the whole file at ``path`` (unsigned 32-bit)."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            piece = f.read(PIECE)  # bytes: what the C extension takes
            if not piece:
                return crc
            crc = google_crc32c.extend(crc, piece)


def chunk_checksums(flat) -> list[int | None]:
    """What a checkpoint records for the FlatArray ``flat``: the crc32c of every chunk
    file in chunk order, ``None`` for a chunk file that does not exist."""
    out: list[int | None] = []
    for i in range(flat.nchunks):
        path = flat.chunk_path(i)
        try:
            out.append(file_crc32c(path))
        except FileNotFoundError:
            out.append(None)
    return out


class ShardedPlan(NamedTuple):
    """Where everything goes: ``arrays`` {array: {"dtype", "numel"}} and ``tensors`` (the
    tensor table) for the group's attributes, ``shards`` {rank: shard table}, and
    ``writes`` [(array, offset, values)] for the states given as tensors."""

    arrays: dict
    tensors: dict
    shards: dict
    writes: list


def row_blocks(rows: int, world_size: int) -> list[tuple[int, int]]:
    """(row_start, rows) per rank, as ``torch.chunk`` splits rows (FSDP2 Shard(0))."""
    out, start = [], 0
    for n in fsdp_rows(rows, world_size):
        out.append((start, n))
        start += n
    return out


def plan_sharded(tensors: dict, world_size: int) -> ShardedPlan:
    """Lay ``tensors`` out over ``world_size`` ranks (see ``write_sharded``)."""
    arrays: dict[str, dict] = {}
    cursors: dict[str, int] = {}
    entries = {}
    shards: dict[int, dict] = {r: {} for r in range(world_size)}
    writes = []
    for name, spec in tensors.items():
        shape = list(spec["shape"])
        rows = tensor_rows(shape)
        row_numel = math.prod(shape[1:])
        zdtypes = {state: dtypes.dtype(value.dtype if isinstance(value, torch.Tensor) else value).name
                   for state, value in spec["states"].items()}
        if "boxes" in spec:  # [(start, shape) or None per rank]: a tensor held as boxes
            for r, box in enumerate(spec["boxes"]):
                if box is None:
                    continue
                start, extent = box
                states = {}
                for state, value in spec["states"].items():
                    array = f"rank{r}/{state}" + ("" if zdtypes[state] == "float32"
                                                  else f"_{zdtypes[state]}")
                    arrays.setdefault(array, {"dtype": zdtypes[state], "numel": 0})
                    offset = cursors.get(array, 0)
                    cursors[array] = offset + math.prod(extent)
                    states[state] = (array, offset)
                    if isinstance(value, torch.Tensor):
                        part = value[tuple(slice(a, a + n) for a, n in zip(start, extent))]
                        writes.append((array, offset, part.reshape(-1)))
                shards[r][name] = box_shard_entry(start, extent, states)
            entries[name] = tensor_entry(shape, dtypes.dtype(spec["dtype"]).name,
                                         spec.get("optimizer"), zdtypes, [], world_size,
                                         spec["boxes"])
            continue
        blocks = row_blocks(rows, world_size)
        for r, (row_start, nrows) in enumerate(blocks):
            numel = nrows * row_numel
            states = {}
            for state, value in spec["states"].items():
                zdtype = zdtypes[state]
                array = f"rank{r}/{state}" + ("" if zdtype == "float32" else f"_{zdtype}")
                arrays.setdefault(array, {"dtype": zdtype, "numel": 0})
                offset = cursors.get(array, 0)
                cursors[array] = offset + numel
                states[state] = (array, offset)
                if isinstance(value, torch.Tensor) and numel:
                    flat = value.reshape(-1)
                    writes.append((array, offset,
                                   flat[row_start * row_numel:row_start * row_numel + numel]))
            shards[r][name] = shard_entry(row_start, nrows, numel, states)
        entries[name] = tensor_entry(shape, dtypes.dtype(spec["dtype"]).name, spec.get("optimizer"),
                                     zdtypes, [n for _, n in blocks], world_size)
    for array, n in cursors.items():
        arrays[array]["numel"] = n
    return ShardedPlan(arrays, entries, shards, writes)


def write_sharded(group: str, tensors: dict, world_size: int, *, kind: str = "checkpoint",
                  step: int = 0, chunk_bytes: int = 64 * MiB, data: bool = True,
                  io: AsyncFileIO | None = None,
                  format_version: int = CHECKPOINT_VERSION) -> dict:
    """Write a store directory or one checkpoint generation at ``group``.

    ``tensors``: ``{name: {"shape": [...], "dtype": torch dtype of the parameter,
    "optimizer": "muon" | "adamw" | None, "states": {state: tensor or torch dtype}}}``;
    a spec with ``"boxes"`` (``[(start, shape) or None]`` per rank) is saved as those boxes
    (docs/format.md, "Boxes"; needs ``format_version`` 4 in a checkpoint).
    A state given as a tensor (the full, unsharded value) is written; given as a dtype,
    only the manifest and array metadata are (``data=False`` does this for all: chunk
    files absent, reading as zeros). A checkpoint is written in ``format_version``: 3 and 4
    record the crc32c of every metadata file and seals the manifest, 2 (what earlier
    releases wrote) does not. Returns the group's attributes as written.
    """
    own_io = io is None
    io = io or AsyncFileIO(threads=4, queue_depth=4)
    try:
        plan = plan_sharded(tensors, world_size)
        if kind == "store":
            for meta in plan.arrays.values():
                size = torch.empty((), dtype=dtypes.zarr_dtype(meta["dtype"]).torch).element_size()
                meta.update(home="nvme", bucket_elems=chunk_bytes // size)
        flats = {a: FlatArray.create(os.path.join(group, a), m["numel"], dtypes.zarr_dtype(m["dtype"]).torch,
                                     io=io, chunk_bytes=chunk_bytes, overwrite=True)
                 for a, m in plan.arrays.items()}
        if data:
            for array, offset, values in plan.writes:
                flats[array].write(offset, values.to(flats[array].dtype).contiguous())
        for r, table in plan.shards.items():
            write_shard_table(group, r, table)
        attrs = {"format": FORMATS[kind],
                 "format_version": format_version if kind == "checkpoint" else MANIFEST_VERSION,
                 "arrays": plan.arrays, "world_size": world_size, "step": step,
                 "tensors": plan.tensors}
        sealed = kind == "checkpoint" and format_version >= 3  # sealed since version 3
        if kind == "checkpoint":
            for flat in flats.values():
                flat.sync().result()
            attrs["checksums"] = {a: chunk_checksums(f) for a, f in flats.items()}
            attrs["committed"] = True
        if sealed:
            attrs[METADATA_KEY] = files_crc32c(group, metadata_files(world_size, plan.arrays))
        create_group(group, attrs, exist_ok=True, sealed=sealed)
        return attrs
    finally:
        if own_io:
            io.close()


def metadata_files(world_size: int, arrays) -> list[str]:
    """Every metadata file of a generation but its manifest, as the manifest names them."""
    return ([shard_table_key(r) for r in range(world_size)]
            + [array_metadata_key(a) for a in arrays])


def reseal(group: str) -> dict:
    """After a test edited a version 3 generation's metadata on purpose: record the
    checksums of its files as they now are and seal the manifest again, as a forger
    would (so what is tested is the reader's other checks). Returns the attributes."""
    with open(os.path.join(group, "zarr.json")) as f:
        attrs = json.load(f)["attributes"]
    world = attrs.get("world_size")
    ranks = [r for r in range(world) if os.path.exists(os.path.join(group, shard_table_key(r)))] \
        if type(world) is int and world < 10_000 else [0]
    names = [shard_table_key(r) for r in ranks] + [
        array_metadata_key(a) for a in attrs.get("arrays", {})
        if os.path.isfile(os.path.join(group, array_metadata_key(a)))]
    attrs[METADATA_KEY] = files_crc32c(group, names)
    create_group(group, attrs, exist_ok=True, sealed=True)
    return attrs


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
