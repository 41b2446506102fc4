"""The manifest of a store or checkpoint generation, in two parts (docs/format.md, "Manifest").

- The **tensor table**, in the group's own attributes: one small entry per logical tensor
  (global shape, dtype, optimizer, its states and their dtypes), next to the step, the
  world size, the arrays and the checksums. Listing reads this and nothing else.
- One **shard table** per rank, in the attributes of the group ``rank{r}`` (the folder
  that holds rank r's arrays): where that rank's rows of every tensor sit in its arrays.
  Reading data reads the tables of the ranks it needs. A live store holds one rank, in
  its own folder: its shard table is the ``shards`` attribute of the store's group.

A per-shard list in the tensor table made a 50,000-tensor, 8-rank manifest 61 MB (134 MB
indented) that listing had to parse; the tensor table alone is about 7 MB.

Rows follow FSDP2 ``Shard(0)``: rank r holds ``ceil(rows / world)`` rows (torch.chunk
sizes, the last ranks short or empty), in rank order. A tensor held otherwise (a
replicated parameter, saved by rank 0 or kept whole by every rank's store) lists its
``rows_per_rank``. A tensor whose parts are not blocks of whole rows in rank order (tensor
parallel's rectangles, a 2-D mesh's blocks) lists one **box** per rank instead,
``boxes_per_rank``, and its shards record their box (``box_shard_entry``).
"""

from __future__ import annotations

import math
import os
from functools import lru_cache

from .. import dtypes
from ..units import MiB
from .group import create_group, read_group
from .group_entries import iter_attribute_members
from .metadata import MetadataError, metadata_path

SHARDS = "shards"
# 2: the shard tables left the tensor table (version 1 listed every shard in it). Stores
# write 2; so did checkpoints before their metadata was checksummed.
MANIFEST_VERSION = 2
# 3: a live store of one rank is one folder: its arrays carry no rank prefix, and its
# shard table is the group's own ``shards`` attribute beside the tensor table (version 2
# nested them in a group rank{r} inside the rank's folder: store/rank0/rank0/<array>)
STORE_VERSION = 3
# 3: a checkpoint's manifest records the crc32c of every other metadata file and ends with
# its seal (metadata_crc.py); the tables themselves are version 2's
METADATA_CRC_VERSION = 3
# 4: a generation may hold each rank's training state (rank{r}/training_state, checksummed
# like the shard tables), parameters outside the optimizer ("frozen": true), tied names
# ("aliases") and a user-chosen name (a tag). Versions 2 and 3 stay readable.
CHECKPOINT_VERSION = 4
# 4 also: shards may be boxes, and a rank may hold no arrays (an HSDP replica above the
# first saves nothing): a version 3 reader would misread a box, and refuses 4 by its number
BOX_CHECKPOINT_VERSION = CHECKPOINT_VERSION
# chunk files of a generation's packed arrays (its parameters, and every array an import
# writes), bytes
CHUNK_BYTES = 64 * MiB


def rank_group(rank: int) -> str:
    """Name of the child group holding rank ``rank``'s arrays and shard table."""
    return f"rank{rank}"


def array_name(rank: int, key: str, dtype) -> str:
    """Name in a generation of rank ``rank``'s array of ``key`` (a state, ``param`` or
    ``buffer``) in ``dtype`` (a DType, torch dtype or name): ``rank0/exp_avg`` for float32,
    ``rank0/param.bfloat16`` otherwise."""
    name = dtypes.dtype(dtype).name
    return f"{rank_group(rank)}/{key}" + ("" if name == "float32" else "." + name)


def shard_table_path(group: str, rank: int) -> str:
    """The zarr.json that holds rank ``rank``'s shard table."""
    return metadata_path(os.path.join(group, rank_group(rank)))


@lru_cache(maxsize=4096)  # tensors share a few row counts: one tuple each, not one per tensor
def fsdp_rows(rows: int, world: int) -> tuple[int, ...]:
    """Rows each of ``world`` ranks holds under FSDP2 ``Shard(0)`` (torch.chunk sizes)."""
    per = -(-rows // world) if rows else 0
    return tuple(min(rows, (r + 1) * per) - min(rows, r * per) for r in range(world))


def tensor_rows(shape) -> int:
    """Rows of a tensor of ``shape`` (a 0-d tensor is one row of one element)."""
    return shape[0] if shape else 1


def tensor_entry(shape, dtype: str, optimizer: str | None, states: dict[str, str],
                 rows_per_rank, world: int, boxes=None) -> dict:
    """One tensor table entry. ``states``: {state key: zarr dtype name}; ``rows_per_rank``
    is recorded only where it is not the FSDP2 split of the rows over ``world`` ranks.
    ``boxes``, for a tensor not split by rows: per rank ``(start, shape)`` of the box it
    holds, or None where it holds nothing (``rows_per_rank`` is then ignored)."""
    entry = {"shape": list(shape), "dtype": dtype, "optimizer": optimizer, "states": states}
    if boxes is not None:
        entry["boxes_per_rank"] = [None if b is None else [list(b[0]), list(b[1])] for b in boxes]
        return entry
    if tuple(rows_per_rank) != fsdp_rows(tensor_rows(shape), world):
        entry["rows_per_rank"] = list(rows_per_rank)
    return entry


def held_ranks(attrs: dict) -> list[int]:
    """Ranks whose shard tables the group holds: a live store records its own ``rank``;
    a checkpoint (or a store holding every rank) holds all of ``world_size``."""
    if "rank" in attrs:
        return [attrs["rank"]]
    world = attrs.get("world_size")
    return list(range(world)) if isinstance(world, int) and not isinstance(world, bool) else []


def shard_entry(row_start: int, rows: int, numel: int, states: dict[str, tuple[str, int]]) -> dict:
    """One shard table entry: rows ``[row_start, row_start + rows)`` (``numel`` elements);
    state ``key`` is elements ``[offset, offset + numel)`` of array ``states[key][0]``."""
    return {"row_start": row_start, "rows": rows, "numel": numel,
            "states": {k: {"array": a, "offset": o} for k, (a, o) in states.items()}}


def box_shard_entry(start, shape, states: dict[str, tuple[str, int]]) -> dict:
    """One shard table entry of a box: index ranges ``[start[d], start[d] + shape[d])`` of
    the tensor, ``prod(shape)`` elements stored row-major from ``offset`` of each state's
    array."""
    return {"start": list(start), "shape": list(shape), "numel": math.prod(shape),
            "states": {k: {"array": a, "offset": o} for k, (a, o) in states.items()}}


def write_shard_table(group: str, rank: int, shards: dict) -> None:
    """Write rank ``rank``'s shard table ``{tensor name: shard entry}`` (atomically)."""
    create_group(os.path.join(group, rank_group(rank)), {SHARDS: shards}, exist_ok=True)


def shard_table_key(rank: int) -> str:
    """Rank ``rank``'s shard table as the manifest's ``metadata_checksums`` names it."""
    return f"{rank_group(rank)}/zarr.json"


def array_metadata_key(array: str) -> str:
    """Array ``array``'s zarr.json as the manifest's ``metadata_checksums`` names it."""
    return f"{array}/zarr.json"


def rank_metadata_files(rank: int, arrays) -> list[str]:
    """The metadata files rank ``rank`` writes into a generation, as the manifest names
    them: its shard table and the zarr.json of each of its ``arrays``."""
    return [shard_table_key(rank)] + [array_metadata_key(a) for a in arrays]


def read_shard_table(group: str, rank: int, crc32c: int | None = None) -> dict:
    """Rank ``rank``'s shard table; ``crc32c``, where the manifest records one, is checked
    against the file's bytes first. NodeNotFoundError when the rank's group is missing,
    ChecksumError or MetadataError (naming the file) when it is corrupt or holds no table."""
    table = read_group(os.path.join(group, rank_group(rank)), crc32c).get(SHARDS)
    if not isinstance(table, dict):
        raise MetadataError(f"{shard_table_path(group, rank)}: no shard table (a 'shards' "
                            f"object in the attributes of rank {rank}'s group)")
    return table


def iter_shard_table(group: str, rank: int, crc32c: int | None = None):
    """Rank ``rank``'s shard table as ``(tensor, shard)`` pairs parsed one at a time, so a
    table of 100,000 tensors is never whole in memory; errors as ``read_shard_table``'s,
    raised as the pairs are read (a corrupt end of the file after its first pairs)."""
    return iter_attribute_members(os.path.join(group, rank_group(rank)), SHARDS, crc32c)


# -- what a group is -------------------------------------------------------------------------------
# the ``format`` attribute of the two kinds of group our manifests describe
STORE_FORMAT = "offload-engine-store"            # a live TieredStore directory
CHECKPOINT_FORMAT = "offload-engine-checkpoint"  # one checkpoint generation
