"""The ranks' shard tables of a store or checkpoint (docs/format.md, "Manifest"), checked
against the tensor table and turned into the array ranges that hold each tensor state.

Everything here is metadata: nothing reads a chunk file. Each shard state becomes a
``Placement``: elements ``[dest, dest + numel)`` of the flattened logical tensor are
elements ``[offset, offset + numel)`` of an array. Row blocks (FSDP2 ``Shard(0)``) are
contiguous in row-major order, so a shard starting at row ``row_start`` lands at
``dest = row_start * (elements per row)``.

Tables are added one rank at a time, so only one rank's parsed JSON is alive at once.
"""

from __future__ import annotations

import math

from .errors import InspectError
from .manifest import Manifest, Placement

_EMPTY: dict = {}
_new_placement = tuple.__new__  # Placement without the namedtuple constructor's frame


class ShardTables:
    """Collects the placements of every (tensor, state) from the ranks' tables."""

    def __init__(self, manifest: Manifest):
        self.m = manifest
        self._tensors = {t.name: t for t in manifest.tensors}
        self._row_numel = {t.name: math.prod(t.shape[1:]) for t in manifest.tensors}
        self._numels = {n: a.numel for n, a in manifest.arrays.items()}
        self._dtypes = {n: a.dtype for n, a in manifest.arrays.items()}
        self._placements: dict[tuple[str, str], list] = {}
        self._covered: dict[str, list] = {}  # tensor -> [(row_start, rows, rank)]

    def add(self, rank: int, doc, where: str) -> None:
        """Rank ``rank``'s table ``{tensor: shard}``, read from ``where`` (named in errors).
        The checks run on every shard, so they are written for speed."""
        if type(doc) is not dict:
            raise InspectError(f"{where}: 'shards' must be an object {{tensor: shard}}")
        tensors, row_numels, numels, dtypes = self._tensors, self._row_numel, self._numels, self._dtypes
        rows_of, placements, covered = self.m.rows, self._placements, self._covered
        for name, shard in doc.items():
            t = tensors.get(name)
            if t is None:
                raise InspectError(f"{where}: tensor {name!r} has a shard on rank {rank} but is "
                                   f"not in the tensor table")
            if type(shard) is not dict:
                raise InspectError(f"{where}: tensor {name!r}: the shard must be an object")
            try:
                row_start, nrows, numel = shard["row_start"], shard["rows"], shard["numel"]
            except KeyError as e:
                raise InspectError(f"{where}: tensor {name!r}: a shard has no {e.args[0]!r}") from None
            if not (type(row_start) is int and type(nrows) is int and type(numel) is int
                    and row_start >= 0 and nrows >= 0 and numel >= 0):
                raise InspectError(f"{where}: tensor {name!r}: a shard's row_start, rows and "
                                   f"numel must be integers >= 0, got {row_start!r}, "
                                   f"{nrows!r}, {numel!r}")
            row_numel = row_numels[name]
            if numel != nrows * row_numel:
                raise InspectError(f"{where}: tensor {name!r}, rank {rank}: numel {numel} is not "
                                   f"rows {nrows} x {row_numel} elements per row")
            expected = rows_of[name][rank]
            if nrows != expected:
                raise InspectError(f"{where}: tensor {name!r}: rank {rank} holds {nrows} rows, "
                                   f"the tensor table says {expected}")
            states = shard.get("states", _EMPTY)
            if type(states) is not dict or states.keys() != t.states.keys():
                raise InspectError(_bad_states(where, name, rank, states, t.states))
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
                if dtypes[array] != t.states[state].dtype:
                    raise InspectError(f"{where}: tensor {name!r}, rank {rank}, state {state!r}: "
                                       f"array {array!r} holds {dtypes[array]}, the tensor table "
                                       f"says {t.states[state].dtype}")
                acc = placements.get((name, state))
                if acc is None:
                    acc = placements[(name, state)] = []
                acc.append(_new_placement(Placement, (dest, numel, array, offset, rank)))
            cov = covered.get(name)
            if cov is None:
                cov = covered[name] = []
            cov.append((row_start, nrows, rank))

    def finish(self, where: str) -> dict[tuple[str, str], list[Placement]]:
        """The placements, sorted, once every held rank was added: a group holding every
        rank must tile each tensor's rows exactly; a live store must hold every row the
        tensor table gives its rank. ``where`` (the group) is named in errors."""
        for t in self.m.tensors:
            cov = self._covered.get(t.name, [])
            if self.m.all_ranks:
                _check_rows(cov, t.shape[0] if t.shape else 1, f"tensor {t.name!r}", where)
            else:
                have = {r for _, _, r in cov}
                for r in self.m.ranks:
                    if r not in have and self.m.rows[t.name][r]:
                        raise InspectError(f"{where}: tensor {t.name!r}: rank {r}'s shard table "
                                           f"has no entry, the tensor table gives it "
                                           f"{self.m.rows[t.name][r]} rows")
        for pls in self._placements.values():
            pls.sort()
        return self._placements


def _bad_states(where, name, rank, states, want) -> str:
    head = f"{where}: tensor {name!r}, rank {rank}"
    if type(states) is not dict:
        return f"{head}: 'states' must be an object"
    missing = sorted(set(want) - set(states))
    if missing:
        return f"{head}: state(s) {missing} of the tensor table are missing from the shard"
    return f"{head}: state(s) {sorted(set(states) - set(want))} are not in the tensor table"


def _bad_ref(where, name, rank, state, ref, numel, numels) -> str:
    head = f"{where}: tensor {name!r}, rank {rank}, state {state!r}"
    if type(ref) is not dict or ref.get("array") not in numels:
        array = ref.get("array") if type(ref) is dict else ref
        return f"{head}: array {array!r} is not in 'arrays'"
    offset = ref.get("offset")
    if not (type(offset) is int and offset >= 0):
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
