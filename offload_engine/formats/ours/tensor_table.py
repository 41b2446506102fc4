"""The tensor table of a store or checkpoint generation (group attributes, docs/format.md),
checked and turned into logical tensors: everything listing shows, from the group's
zarr.json alone.

Per-rank bytes come from the row split (FSDP2 ``Shard(0)``, or a tensor's
``rows_per_rank``) or its ``boxes_per_rank``, not from the shard tables: those are parsed
only when data is read (``shard_tables.py``), and are checked there against this table.
"""

from __future__ import annotations

import contextlib
import gc
import math
import re
from dataclasses import dataclass, field
from typing import NamedTuple

from ... import dtypes
from ...dtypes import DType
from ...layout import MetadataError, NodeNotFoundError, read_group
from ...layout.manifest import (BOX_CHECKPOINT_VERSION, CHECKPOINT_FORMAT, CHECKPOINT_VERSION,
                                MANIFEST_VERSION, METADATA_CRC_VERSION, SHARDS, STORE_FORMAT,
                                STORE_VERSION, array_metadata_key,
                                shard_table_key)
from ...layout.member_paths import name_problem
from ...layout.metadata_crc import METADATA_KEY, SEAL_KEY
from ..errors import CheckpointError
from .bounds import RowSplit, check_capacity, held_ranks_checked
from ..source import StateMeta, TensorMeta

FORMATS = {"store": STORE_FORMAT, "checkpoint": CHECKPOINT_FORMAT}
# version 2 checkpoints (written before metadata checksums) stay readable, and so do
# version 2 stores (the rank's arrays and shard table one level down, in group rank{r})
KNOWN_VERSIONS = {"store": (MANIFEST_VERSION, STORE_VERSION),
                  "checkpoint": (MANIFEST_VERSION, METADATA_CRC_VERSION, CHECKPOINT_VERSION)}
_RANK_PREFIX = re.compile(r"^rank(\d+)/")
_RANK_TABLE = re.compile(r"rank(\d+)/zarr\.json")
_RANK_STATE = re.compile(r"rank(\d+)/training_state/zarr\.json")  # version 4
_SEAL = re.compile(r"[0-9a-f]{8}")


class Placement(NamedTuple):
    """Elements ``[dest, dest + numel)`` of a logical tensor's state are elements
    ``[offset, offset + numel)`` of array ``array``, held by ``rank``. (A tuple: a
    manifest of 50,000 tensors over 8 ranks makes over half a million of them.)

    A box (``box`` = ``(start, shape)``, docs/format.md) is ``numel`` elements of the array
    too, but in the tensor they are runs from ``dest`` on (``layout.box_runs``)."""

    dest: int
    numel: int
    array: str
    offset: int
    rank: int | None
    box: tuple | None = None


@dataclass
class ArrayEntry:
    name: str
    dtype: DType
    numel: int
    home: str | None
    rank: int | None
    chunk_elems: int | None = None  # a store's bucket_elems (its chunk size), when recorded


@dataclass
class Manifest:
    format: str
    format_version: int
    step: int | None
    world_size: int | None
    arrays: dict[str, ArrayEntry]
    tensors: list[TensorMeta]
    ranks: list[int]                        # ranks whose shard tables the group holds
    rows: dict[str, list[int] | RowSplit]   # tensor -> rows (a box tensor: elements) per rank
    checksums: dict[str, list] | None = None
    # {path inside the group: crc32c} of every metadata file but the manifest (version 3
    # checkpoints); None where the metadata is not checksummed (stores, version 2)
    metadata_crcs: dict[str, int] | None = None
    committed: bool | None = None
    has_tensor_table: bool = True
    placements: dict | None = None          # known at once only for a store without tensors
    extra: dict = field(default_factory=dict)
    # the group's own attributes hold its one rank's shard table, ``shards`` (a store
    # since version 3, whose arrays sit in its own folder with no rank prefix)
    inline_shards: bool = False
    # tensor -> per rank (start, shape) of its box or None: the tensors held as boxes
    boxes: dict = field(default_factory=dict)

    @property
    def all_ranks(self) -> bool:
        """Whether the group holds every rank (a checkpoint), not one (a live store)."""
        return (self.world_size is not None and len(self.ranks) == self.world_size
                and self.ranks == list(range(self.world_size)))


@contextlib.contextmanager
def gc_paused():
    """No cyclic garbage collection while a large manifest becomes many small objects
    (none of them cyclic). Re-enabling alone would only defer the cost: the first
    young-generation collection would then walk every object made meanwhile (1.2 s for the
    manifest of 50,000 tensors over 8 ranks). ``freeze`` + ``unfreeze`` moves them straight
    to the oldest generation instead, which is collected only rarely. (A short-lived
    process can ``gc.freeze()`` for good afterwards, as the command line does.)"""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        if was:
            gc.enable()


def read_manifest_attrs(group: str) -> dict:
    """The group's attributes, its seal checked where it has one (a checkpoint since
    version 3): every reader of a manifest reads it here. A missing or corrupt zarr.json is
    a CheckpointError naming it, a seal that does not match its bytes a ChecksumError."""
    try:
        return read_group(group, verify_seal=True)
    except (NodeNotFoundError, MetadataError) as e:
        raise CheckpointError(str(e)) from None


def _int(value, what: str, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CheckpointError(f"{where}: {what} must be an integer >= {minimum}, got {value!r}")
    return value


def _dtype(name, what: str, where: str) -> DType:
    try:
        return dtypes.zarr_dtype(name)
    except (ValueError, TypeError):
        raise CheckpointError(f"{where}: {what} has unknown dtype {name!r}") from None


def parse_manifest(attrs: dict, kind: str, where: str) -> Manifest:
    """Check the manifest of a ``kind`` ("store" or "checkpoint") group; ``where`` is the
    group's zarr.json, named in every error."""
    fmt = attrs.get("format")
    if fmt != FORMATS[kind]:
        raise CheckpointError(f"{where}: manifest format is {fmt!r}, expected {FORMATS[kind]!r}")
    version = attrs.get("format_version")
    if type(version) is not int or version not in KNOWN_VERSIONS[kind]:
        raise CheckpointError(f"{where}: format_version {version!r} is not supported (this "
                              f"offload-engine reads {', '.join(map(str, KNOWN_VERSIONS[kind]))})")
    step = attrs.get("step")
    if step is not None:
        step = _int(step, "'step'", where)
    world = attrs.get("world_size")
    if world is not None:
        world = _int(world, "'world_size'", where, 1)
    arrays = _parse_arrays(attrs.get("arrays"), where)
    committed = attrs.get("committed")
    checksums = None
    if kind == "checkpoint":
        if committed is not True:
            raise CheckpointError(f"{where}: the generation is not committed ('committed' is "
                               f"{committed!r}): an interrupted save, not a checkpoint")
        for key in ("step", "world_size", "tensors"):
            if key not in attrs:
                raise CheckpointError(f"{where}: the checkpoint manifest has no {key!r}")
        checksums = _parse_checksums(attrs.get("checksums"), arrays, where)
    metadata_crcs = None
    if kind == "checkpoint" and version >= METADATA_CRC_VERSION:
        metadata_crcs = _parse_metadata_crcs(attrs, world, arrays, where, version)
    extra = {k: v for k, v in attrs.items()
             if k not in ("format", "format_version", "step", "world_size", "arrays",
                          "tensors", "checksums", "committed", "stripes", METADATA_KEY,
                          SEAL_KEY, SHARDS)}
    tensors_doc = attrs.get("tensors")
    if tensors_doc is None:
        tensors, placements = _bare_arrays(arrays)
        return Manifest(fmt, version, step, world, arrays, tensors, [], {}, checksums,
                        metadata_crcs, committed, False, placements, extra)
    if world is None:
        raise CheckpointError(f"{where}: a manifest with a tensor table needs 'world_size'")
    # a version 4 checkpoint may have ranks without arrays (HSDP replicas); its world size
    # is bounded by metadata_checksums, one entry per rank's shard table
    boxes_ok = kind == "store" or version >= BOX_CHECKPOINT_VERSION
    ranks = held_ranks_checked(attrs, world, arrays, where,
                               empty_ranks_ok=kind == "checkpoint" and boxes_ok)
    # a store of one rank written since version 3 keeps its table beside the tensor table;
    # one without it (version 2, or a store holding every rank) in group rank{r}
    inline = kind == "store" and "rank" in attrs and SHARDS in attrs
    if inline:  # one rank's folder: each of its arrays is that rank's
        for a in arrays.values():
            if a.rank is None:
                a.rank = ranks[0]
    tensors, rows, per_split, boxes = _parse_tensors(tensors_doc, world, ranks, where, boxes_ok)
    check_capacity(per_split, ranks, tensors, arrays, where)  # before a shape sizes anything
    return Manifest(fmt, version, step, world, arrays, tensors, ranks, rows, checksums,
                    metadata_crcs, committed, True, None, extra, inline, boxes)


def _parse_arrays(doc, where: str) -> dict[str, ArrayEntry]:
    if not isinstance(doc, dict):
        raise CheckpointError(f"{where}: manifest has no 'arrays' object")
    out = {}
    for name, entry in doc.items():
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where}: arrays[{name!r}] must be an object")
        problem = name_problem(name)
        if problem is not None:  # the same check readers repeat, with symlinks, at open
            raise CheckpointError(f"{where}: array name {name!r} {problem}; refused (names in "
                                  f"a manifest stay inside its directory)")
        m = _RANK_PREFIX.match(name)
        chunk = entry.get("bucket_elems")
        out[name] = ArrayEntry(name, _dtype(entry.get("dtype"), f"array {name!r}", where),
                               _int(entry.get("numel"), f"numel of array {name!r}", where),
                               entry.get("home"), int(m.group(1)) if m else None,
                               chunk if type(chunk) is int and chunk > 0 else None)
    return out


def _parse_checksums(doc, arrays: dict[str, ArrayEntry], where: str) -> dict[str, list]:
    if not isinstance(doc, dict):
        raise CheckpointError(f"{where}: a checkpoint manifest needs 'checksums' "
                           f"{{array: [crc32c or null per chunk]}}")
    for name, crcs in doc.items():
        if name not in arrays:
            raise CheckpointError(f"{where}: checksums for array {name!r}, which is not in "
                               f"'arrays'")
        if not isinstance(crcs, list) or not all(
                c is None or (type(c) is int and 0 <= c < 2**32) for c in crcs):
            raise CheckpointError(f"{where}: checksums of array {name!r} must be a list of "
                               f"unsigned 32-bit integers or nulls")
    return doc


def _parse_metadata_crcs(attrs: dict, world: int, arrays: dict[str, ArrayEntry],
                         where: str, version: int) -> dict[str, int]:
    """A version 3 or 4 checkpoint's ``metadata_checksums``: one crc32c for each rank's
    shard table and each array's zarr.json, and (version 4, where the manifest says it
    holds ``training_state``) each rank's training state; none for anything else; and the
    seal (checked against the file's bytes by ``read_manifest_attrs``), which it must
    have."""
    if type(attrs.get(SEAL_KEY)) is not str or not _SEAL.fullmatch(attrs[SEAL_KEY]):
        raise CheckpointError(f"{where}: a version 3 checkpoint manifest ends with "
                              f"'{SEAL_KEY}' (8 hex digits); this one has "
                              f"{attrs.get(SEAL_KEY)!r}: damaged")
    doc = attrs.get(METADATA_KEY)
    if type(doc) is not dict:
        raise CheckpointError(f"{where}: a version 3 checkpoint manifest needs "
                              f"'{METADATA_KEY}' {{file: crc32c}}")
    states = world if version >= CHECKPOINT_VERSION and "training_state" in attrs else 0
    for name, crc in doc.items():
        m = _RANK_TABLE.fullmatch(name)
        s = _RANK_STATE.fullmatch(name) if states else None
        known = ((m is not None and int(m.group(1)) < world and name == shard_table_key(int(m.group(1))))
                 or (s is not None and int(s.group(1)) < world
                     and name == f"rank{int(s.group(1))}/training_state/zarr.json")
                 or (name.endswith("/zarr.json") and name[:-len("/zarr.json")] in arrays))
        if not known:
            raise CheckpointError(f"{where}: {METADATA_KEY} names {name!r}, neither a rank's "
                                  f"shard table nor the zarr.json of an array in 'arrays'")
        if type(crc) is not int or not 0 <= crc < 2**32:
            raise CheckpointError(f"{where}: {METADATA_KEY}[{name!r}] must be an unsigned "
                                  f"32-bit integer, got {crc!r}")
    if len(doc) != world + len(arrays) + states:  # each name is one of these files: so all are there
        missing = next((k for k in [array_metadata_key(a) for a in arrays] if k not in doc),
                       None) or next(k for r in range(world) for k in
                                     [shard_table_key(r)] + ([f"rank{r}/training_state/zarr.json"]
                                                             if states else [])
                                     if k not in doc)
        raise CheckpointError(f"{where}: {METADATA_KEY} has no checksum for {missing!r}")
    return doc


def _bare_arrays(arrays: dict[str, ArrayEntry]):
    """A store whose optimizer recorded no tensors: each flat array is listed as itself."""
    tensors, placements = [], {}
    for name in sorted(arrays):
        a = arrays[name]
        state = name.rsplit("/", 1)[-1]
        itemsize = a.dtype.itemsize
        tensors.append(TensorMeta(name, (a.numel,), a.dtype, None,
                                  {state: StateMeta(a.dtype, a.numel, {a.rank: a.numel * itemsize})},
                                  kind="array", home=a.home))
        placements[(name, state)] = [Placement(0, a.numel, name, 0, a.rank)]
    return tensors, placements


def _nat(value) -> bool:
    return type(value) is int and value >= 0


def _parse_tensors(doc, world: int, ranks: list[int], where: str, boxes_ok: bool = False):
    """The tensor table: TensorMeta per entry and the rows each rank holds (a tensor with
    ``boxes_per_rank``: the elements, and its boxes). Runs once per tensor at listing, so
    the checks are written for speed; messages are built on failure."""
    if not isinstance(doc, dict):
        raise CheckpointError(f"{where}: 'tensors' must be an object {{name: entry}}")
    known_dtypes: dict[str, DType] = {}  # zarr name -> dtype, checked once
    split_of: dict[int, RowSplit] = {}  # rows -> their FSDP2 split: tensors share a few
    per_split: dict = {}  # (rows per rank, dtype) -> elements per row of the states using both
    all_ranks = len(ranks) == world and ranks == list(range(world))
    tensors, rows_of, boxes_of = [], {}, {}
    # equal StateMeta and states dicts are shared between tensors: a mixture-of-experts
    # checkpoint has 100,000 tensors of a few shapes (nothing changes them once built)
    shared: dict = {}
    for name, entry in doc.items():
        if type(entry) is not dict:
            raise CheckpointError(f"{where}: tensor {name!r} must be an object")
        shape = entry.get("shape")
        if type(shape) is not list or not all(_nat(d) for d in shape):
            raise CheckpointError(f"{where}: tensor {name!r}: 'shape' must be a list of integers "
                               f">= 0, got {shape!r}")
        shape = tuple(shape)
        dtype = _dtype(entry.get("dtype"), f"tensor {name!r}", where)
        rows = shape[0] if shape else 1
        row_numel = math.prod(shape[1:])
        counts = entry.get("rows_per_rank")
        if "boxes_per_rank" in entry:
            if not boxes_ok:
                raise CheckpointError(f"{where}: tensor {name!r} has 'boxes_per_rank', which "
                                      f"format_version {BOX_CHECKPOINT_VERSION} introduced; this "
                                      f"manifest says an earlier version: damaged or forged")
            boxes_of[name] = _parse_boxes(entry["boxes_per_rank"], shape, world, all_ranks,
                                          f"{where}: tensor {name!r}")
            counts = tuple(0 if b is None else math.prod(b[1]) for b in boxes_of[name])
            row_numel = 1  # counts are elements: bytes per rank are counts * itemsize
        elif counts is None:
            counts = split_of.get(rows)
            if counts is None:
                counts = split_of[rows] = RowSplit(rows, world)
        elif (type(counts) is not list or len(counts) != world or not all(_nat(c) for c in counts)
              or (all_ranks and sum(counts) != rows)):
            raise CheckpointError(f"{where}: tensor {name!r}: 'rows_per_rank' must list the rows "
                               f"of each of the {world} ranks" + (f", adding up to {rows}"
                                                                  if all_ranks else "")
                               + f", got {counts!r}")
        else:
            counts = tuple(counts)  # a key of per_split below
        states = entry.get("states")
        if type(states) is not dict or not states:
            raise CheckpointError(f"{where}: tensor {name!r} has no 'states' object "
                               f"{{state: dtype}}")
        numel = math.prod(shape)
        states_meta = {}
        for state, sdtype in states.items():
            known = known_dtypes.get(sdtype) if type(sdtype) is str else None
            if known is None:
                known = known_dtypes[sdtype] = _dtype(sdtype, f"tensor {name!r}, state {state!r},", where)
            per_row = row_numel * known.itemsize
            key = ("state", known.name, numel, per_row, counts)
            sm = shared.get(key)
            if sm is None:
                sm = shared[key] = StateMeta(known, numel, {r: counts[r] * per_row for r in ranks})
            states_meta[state] = sm
            key = (counts, known)  # elements per row, summed by split and dtype (bounds.py)
            per_split[key] = per_split.get(key, 0) + row_numel
        optimizer = entry.get("optimizer")
        if optimizer is not None and type(optimizer) is not str:
            raise CheckpointError(f"{where}: tensor {name!r}: 'optimizer' must be a string")
        kind = ("buffer" if entry.get("buffer") is True
                else "frozen" if entry.get("frozen") is True else "param")
        states_key = ("states",) + tuple((k, id(v)) for k, v in states_meta.items())
        states_meta = shared.setdefault(states_key, states_meta)
        meta = TensorMeta(name, shape, dtype, optimizer, states_meta, kind=kind)
        step = entry.get("adam_step")
        if step is not None:
            meta.extra["adam_step"] = step
        tensors.append(meta)
        rows_of[name] = counts
    return tensors, rows_of, per_split, boxes_of


def _parse_boxes(doc, shape: tuple, world: int, all_ranks: bool, what: str) -> list:
    """A tensor's ``boxes_per_rank``: per rank ``(start, shape)`` tuples inside the tensor,
    or None. In a group of every rank their elements add up to the tensor's (the boxes
    also must not overlap: checked when a reader first reads the tensor)."""
    if type(doc) is not list or len(doc) != world:
        raise CheckpointError(f"{what}: 'boxes_per_rank' must list the box of each of the "
                              f"{world} ranks ([start, shape] or null), got {doc!r:.200}")
    out, total, nd = [], 0, len(shape)
    for r, b in enumerate(doc):
        if b is None:
            out.append(None)
            continue
        if not (type(b) is list and len(b) == 2 and all(
                type(v) is list and len(v) == nd and all(_nat(x) for x in v) for v in b)
                and all(s + e <= n for s, e, n in zip(b[0], b[1], shape))):
            raise CheckpointError(f"{what}: rank {r}'s box must be [start, shape], two lists "
                                  f"of {nd} integers >= 0 inside its shape {list(shape)}, "
                                  f"got {b!r:.200}")
        out.append((tuple(b[0]), tuple(b[1])))
        total += math.prod(b[1])
    if all_ranks and total != math.prod(shape):
        raise CheckpointError(f"{what}: the boxes of 'boxes_per_rank' hold {total} elements, "
                              f"the tensor has {math.prod(shape)}")
    return out

