"""The manifest of a store or checkpoint generation (group attributes, docs/format.md),
checked and turned into logical tensors and the array ranges that hold them.

Everything here is metadata: nothing reads a chunk file. Each shard state of a tensor
becomes a ``Placement``: elements ``[dest, dest + numel)`` of the flattened logical
tensor are elements ``[offset, offset + numel)`` of an array. Row blocks (FSDP2
``Shard(0)``) are contiguous in row-major order, so a shard starting at row ``row_start``
lands at ``dest = row_start * (elements per row)``. A shard's parameter may be listed
inside ``states`` (docs/format.md) or next to it as ``"param": {"array", "offset"}`` (what
``checkpoint.save`` writes); both become the state ``param``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from offload_engine.layout import zarr_to_torch

from .errors import InspectError
from .model import StateMeta, TensorMeta

FORMATS = {"store": "offload-engine-store", "checkpoint": "offload-engine-checkpoint"}
KNOWN_VERSIONS = (1,)
_RANK_PREFIX = re.compile(r"^rank(\d+)/")


class Placement(NamedTuple):
    """Elements ``[dest, dest + numel)`` of a logical tensor's state are elements
    ``[offset, offset + numel)`` of array ``array``, held by ``rank``. (A tuple: a
    manifest of 50,000 tensors over 8 ranks makes over a million of them.)"""

    dest: int
    numel: int
    array: str
    offset: int
    rank: int | None


@dataclass
class ArrayEntry:
    name: str
    dtype: torch.dtype
    numel: int
    home: str | None
    rank: int | None


@dataclass
class Manifest:
    format: str
    format_version: int
    step: int | None
    world_size: int | None
    arrays: dict[str, ArrayEntry]
    tensors: list[TensorMeta]
    placements: dict[tuple[str, str], list[Placement]]
    checksums: dict[str, list] | None = None
    committed: bool | None = None
    has_tensor_table: bool = True
    extra: dict = field(default_factory=dict)


def _int(value, what: str, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InspectError(f"{where}: {what} must be an integer >= {minimum}, got {value!r}")
    return value


def _dtype(name, what: str, where: str) -> torch.dtype:
    try:
        return zarr_to_torch(name)
    except ValueError:
        raise InspectError(f"{where}: {what} has unknown dtype {name!r}") from None


def parse_manifest(attrs: dict, kind: str, where: str) -> Manifest:
    """Check the manifest of a ``kind`` ("store" or "checkpoint") group; ``where`` is the
    group's zarr.json, named in every error."""
    fmt = attrs.get("format")
    if fmt != FORMATS[kind]:
        raise InspectError(f"{where}: manifest format is {fmt!r}, expected {FORMATS[kind]!r}")
    version = attrs.get("format_version")
    if version not in KNOWN_VERSIONS:
        raise InspectError(f"{where}: format_version {version!r} is not supported (this "
                           f"offload-engine reads {', '.join(map(str, KNOWN_VERSIONS))})")
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
            raise InspectError(f"{where}: the generation is not committed ('committed' is "
                               f"{committed!r}): an interrupted save, not a checkpoint")
        checksums = attrs.get("checksums")
        if not isinstance(checksums, dict):
            raise InspectError(f"{where}: a checkpoint manifest needs 'checksums' "
                               f"{{array: [crc32c per chunk]}}")
        for name, crcs in checksums.items():
            if name not in arrays:
                raise InspectError(f"{where}: checksums for array {name!r}, which is not in "
                                   f"'arrays'")
            if not isinstance(crcs, list) or not all(
                    c is None or (isinstance(c, int) and not isinstance(c, bool)
                                  and 0 <= c < 2**32) for c in crcs):
                raise InspectError(f"{where}: checksums of array {name!r} must be a list of "
                                   f"unsigned 32-bit integers")
    tensors_doc = attrs.get("tensors")
    if tensors_doc is None:
        tensors, placements = _bare_arrays(arrays)
        has_table = False
    else:
        tensors, placements = _parse_tensors(tensors_doc, arrays, world, where)
        has_table = True
    extra = {k: v for k, v in attrs.items()
             if k not in ("format", "format_version", "step", "world_size", "arrays",
                          "tensors", "checksums", "committed", "stripes")}
    return Manifest(fmt, version, step, world, arrays, tensors, placements, checksums,
                    committed, has_table, extra)


def _parse_arrays(doc, where: str) -> dict[str, ArrayEntry]:
    if not isinstance(doc, dict):
        raise InspectError(f"{where}: manifest has no 'arrays' object")
    out = {}
    for name, entry in doc.items():
        if not isinstance(entry, dict):
            raise InspectError(f"{where}: arrays[{name!r}] must be an object")
        m = _RANK_PREFIX.match(name)
        out[name] = ArrayEntry(name, _dtype(entry.get("dtype"), f"array {name!r}", where),
                               _int(entry.get("numel"), f"numel of array {name!r}", where),
                               entry.get("home"), int(m.group(1)) if m else None)
    return out


def _bare_arrays(arrays: dict[str, ArrayEntry]):
    """A store whose optimizer recorded no tensors: each flat array is listed as itself."""
    tensors, placements = [], {}
    for name in sorted(arrays):
        a = arrays[name]
        state = name.rsplit("/", 1)[-1]
        itemsize = torch.empty((), dtype=a.dtype).element_size()
        tensors.append(TensorMeta(name, (a.numel,), a.dtype, None,
                                  {state: StateMeta(a.dtype, a.numel, {a.rank: a.numel * itemsize})},
                                  kind="array", home=a.home))
        placements[(name, state)] = [Placement(0, a.numel, name, 0, a.rank)]
    return tensors, placements


_EMPTY: dict = {}
_new_placement = tuple.__new__  # Placement without the namedtuple constructor's frame


def _nat(value) -> bool:
    return type(value) is int and value >= 0


def _parse_tensors(doc, arrays: dict[str, ArrayEntry], world: int | None, where: str):
    """The tensor table. Checks run on every shard, so they are written for speed; the
    error message is only built when one fails."""
    if not isinstance(doc, dict):
        raise InspectError(f"{where}: 'tensors' must be an object {{name: entry}}")
    itemsizes = {n: torch.empty((), dtype=a.dtype).element_size() for n, a in arrays.items()}
    numels = {n: a.numel for n, a in arrays.items()}
    dtypes = {n: a.dtype for n, a in arrays.items()}
    tensors, placements = [], {}
    for name, entry in doc.items():
        if type(entry) is not dict:
            raise InspectError(f"{where}: tensor {name!r} must be an object")
        shape = entry.get("shape")
        if type(shape) is not list or not all(_nat(d) for d in shape):
            raise InspectError(f"{where}: tensor {name!r}: 'shape' must be a list of integers "
                               f">= 0, got {shape!r}")
        shape = tuple(shape)
        dtype = _dtype(entry.get("dtype"), f"tensor {name!r}", where)
        rows = shape[0] if shape else 1
        row_numel = math.prod(shape[1:])
        shards = entry.get("shards")
        if type(shards) is not list or not shards:
            raise InspectError(f"{where}: tensor {name!r} has no 'shards' list")
        by_state: dict[str, tuple] = {}  # state -> (placements, bytes per rank, arrays)
        covered = []
        for shard in shards:
            if type(shard) is not dict:
                raise InspectError(f"{where}: tensor {name!r}: every shard must be an object")
            try:
                rank, row_start = shard["rank"], shard["row_start"]
                nrows, numel = shard["rows"], shard["numel"]
            except KeyError as e:
                raise InspectError(f"{where}: tensor {name!r}: a shard has no {e.args[0]!r}") from None
            if not (type(rank) is int and type(row_start) is int and type(nrows) is int
                    and type(numel) is int and rank >= 0 and row_start >= 0 and nrows >= 0
                    and numel >= 0):
                raise InspectError(f"{where}: tensor {name!r}: a shard's rank, row_start, rows "
                                   f"and numel must be integers >= 0, got {rank!r}, "
                                   f"{row_start!r}, {nrows!r}, {numel!r}")
            if world is not None and rank >= world:
                raise InspectError(f"{where}: tensor {name!r} has a shard on rank {rank}, but "
                                   f"world_size is {world}")
            if numel != nrows * row_numel:
                raise InspectError(f"{where}: tensor {name!r}, rank {rank}: numel {numel} is not "
                                   f"rows {nrows} x {row_numel} elements per row")
            covered.append((row_start, nrows, rank))
            states = shard.get("states", _EMPTY)
            if type(states) is not dict:
                raise InspectError(f"{where}: tensor {name!r}, rank {rank}: 'states' must be an "
                                   f"object")
            param = shard.get("param")
            if param is not None:  # the checkpoint writer keeps the parameter beside its states
                states = {"param": param, **states}
            if not states:
                raise InspectError(f"{where}: tensor {name!r}, rank {rank}: shard has no states")
            dest = row_start * row_numel
            for state, ref in states.items():
                try:
                    array, offset = ref["array"], ref["offset"]
                    limit = numels[array]
                except (KeyError, TypeError):
                    raise InspectError(_bad_ref(where, name, rank, state, ref, numel,
                                                numels)) from None
                if type(offset) is not int or offset < 0 or offset + numel > limit:
                    raise InspectError(_bad_ref(where, name, rank, state, ref, numel, numels))
                acc = by_state.get(state)
                if acc is None:
                    acc = by_state[state] = ([], {}, set())
                acc[0].append(_new_placement(Placement, (dest, numel, array, offset, rank)))
                per_rank = acc[1]
                per_rank[rank] = per_rank.get(rank, 0) + numel * itemsizes[array]
                acc[2].add(array)
        _check_rows(covered, rows, f"tensor {name!r}", where)
        states_meta = {}
        for state, (pls, per_rank, used) in by_state.items():
            if len(pls) != len(shards):
                missing = sorted({r for _, _, r in covered} - {p.rank for p in pls})
                raise InspectError(f"{where}: tensor {name!r}: state {state!r} is missing from "
                                   f"the shard of rank(s) {missing}")
            sdtypes = {dtypes[a] for a in used}
            if len(sdtypes) > 1:
                raise InspectError(f"{where}: tensor {name!r}: state {state!r} is held in "
                                   f"arrays of different dtypes")
            pls.sort()
            states_meta[state] = StateMeta(sdtypes.pop(), rows * row_numel, per_rank)
            placements[(name, state)] = pls
        optimizer = entry.get("optimizer")
        if optimizer is not None and type(optimizer) is not str:
            raise InspectError(f"{where}: tensor {name!r}: 'optimizer' must be a string")
        tensors.append(TensorMeta(name, shape, dtype, optimizer, states_meta))
    return tensors, placements


def _bad_ref(where, name, rank, state, ref, numel, numels) -> str:
    head = f"{where}: tensor {name!r}, rank {rank}, state {state!r}"
    if type(ref) is not dict or ref.get("array") not in numels:
        array = ref.get("array") if type(ref) is dict else ref
        return f"{head}: array {array!r} is not in 'arrays'"
    offset = ref.get("offset")
    if not _nat(offset):
        return f"{head}: offset must be an integer >= 0, got {offset!r}"
    return (f"{head}: elements [{offset}, {offset + numel}) run past the "
            f"{numels[ref['array']]} of array {ref['array']!r}")


def _check_rows(covered: list, rows: int, what: str, where: str) -> None:
    """The shards' row blocks must tile [0, rows) exactly."""
    pos = 0
    for row_start, nrows, rank in sorted(covered):
        if nrows == 0:
            continue
        if row_start > pos:
            raise InspectError(f"{where}: {what}: rows [{pos}, {row_start}) are in no shard "
                               f"(a missing rank?)")
        if row_start < pos:
            raise InspectError(f"{where}: {what}: the shard of rank {rank} overlaps rows "
                               f"[{row_start}, {pos})")
        pos = row_start + nrows
    if pos != rows:
        raise InspectError(f"{where}: {what}: shards cover rows [0, {pos}) of {rows} "
                           f"(a missing rank?)")


def rank_of_array(name: str) -> int | None:
    m = _RANK_PREFIX.match(name)
    return int(m.group(1)) if m else None
