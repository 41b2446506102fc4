"""The Hugging Face sharded safetensors layout, planned before any tensor byte is read.

Each file's header comes from the one safetensors codec (``formats.safetensors``);
tensors are laid out by decreasing element size so every tensor starts aligned to its
element size.

Sharding (``huggingface_hub`` ``split_state_dict_into_shards_factory``): walk tensors in
key order; a tensor larger than the limit gets a shard of its own, appended at once while
the current shard stays open; otherwise start a new shard when ``current + size > limit``.
One shard is ``model.safetensors`` with no index; several are
``model-00001-of-0000N.safetensors`` plus ``model.safetensors.index.json`` with
``{"metadata": {"total_size": <sum of tensor bytes>}, "weight_map": {name: file}}``.

Tied weights: an alias is not written; ``{alias: owner}`` goes into the ``__metadata__``
of the file that holds the owner (safetensors ``save_model`` convention) and, when
sharded, into the index ``metadata`` (``huggingface_hub.save_torch_state_dict``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ..dtypes import DType
from ..formats.safetensors import INDEX_FILE, HeaderEntry, encode_header
from ..units import parse_bytes
from ..errors import InputError

SINGLE_FILE = "model.safetensors"  # the names an export may leave: publish.OUTPUT_FILE_PATTERN

def parse_size(text: str | int) -> int:
    """A positive byte count: "5GB" (decimal, 5*10**9, as Hugging Face counts), "500MB",
    "1GiB" (binary) or a plain number of bytes (see ``offload_engine.units``)."""
    value = parse_bytes(text)
    if value <= 0:
        raise InputError(f"shard size must be positive, got {text!r}")
    return value


@dataclass(frozen=True)
class OutTensor:
    """One tensor as written: name, shape and output dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: DType

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Slot:
    """A tensor's place in a file's data region: bytes ``[offset, offset + nbytes)``."""

    tensor: OutTensor
    offset: int


@dataclass(frozen=True)
class ShardPlan:
    """One output file: its name, header bytes and the tensors in data order."""

    filename: str
    header: bytes          # 8-byte length + padded JSON
    slots: tuple[Slot, ...]
    data_bytes: int

    @property
    def data_start(self) -> int:
        return len(self.header)

    @property
    def file_size(self) -> int:
        return len(self.header) + self.data_bytes


def split_shards(tensors: list[OutTensor], max_shard_bytes: int) -> list[list[OutTensor]]:
    """Hugging Face's greedy split in key order (see module docstring), exactly."""
    shards: list[list[OutTensor]] = []
    current: list[OutTensor] = []
    current_size = 0
    for t in tensors:
        size = t.nbytes
        if size > max_shard_bytes:
            shards.append([t])  # its own shard, placed now; the open shard continues
            continue
        if current_size + size > max_shard_bytes:
            shards.append(current)
            current, current_size = [], 0
        current.append(t)
        current_size += size
    if current:
        shards.append(current)
    return shards or [[]]


def shard_filenames(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _header(slots: list[Slot], metadata: dict[str, str]) -> bytes:
    return encode_header({s.tensor.name: HeaderEntry(s.tensor.dtype, s.tensor.shape, s.offset,
                                                     s.offset + s.tensor.nbytes)
                          for s in slots}, metadata)


def plan_files(tensors: list[OutTensor], max_shard_bytes: int,
               aliases: dict[str, str]) -> tuple[list[ShardPlan], dict | None]:
    """Shard plans and the index (None when one file suffices).

    ``aliases`` maps a tied name to the owner name written in its place.
    """
    for t in tensors:
        if t.dtype.safetensors is None:
            raise InputError(f"{t.name}: dtype {t.dtype} has no safetensors code")
    groups = split_shards(tensors, max_shard_bytes)
    names = shard_filenames(len(groups))
    plans = []
    weight_map: dict[str, str] = {}
    for filename, group in zip(names, groups):
        # decreasing element size keeps each tensor aligned; stable, so key order otherwise
        ordered = sorted(group, key=lambda t: -t.dtype.itemsize)
        slots, offset = [], 0
        for t in ordered:
            slots.append(Slot(t, offset))
            offset += t.nbytes
            weight_map[t.name] = filename
        owners = {t.name for t in group}
        metadata = {"format": "pt"}
        metadata.update({a: o for a, o in sorted(aliases.items()) if o in owners})
        plans.append(ShardPlan(filename, _header(slots, metadata), tuple(slots), offset))
    if len(plans) == 1:
        return plans, None
    index_meta: dict = {"total_size": sum(t.nbytes for t in tensors)}
    index_meta.update(aliases)
    index = {"metadata": index_meta, "weight_map": dict(sorted(weight_map.items()))}
    return plans, index


def index_text(index: dict) -> str:
    """The index as DeepSpeed and transformers write it: 2-space indent, sorted keys."""
    return json.dumps(index, indent=2, sort_keys=True) + "\n"
