"""The ranks' shard tables of a store or checkpoint (docs/format.md, "Manifest"), checked
against the tensor table and turned into the array ranges that hold each tensor state.

Everything here is metadata: nothing reads a chunk file. Each shard state becomes a
``Placement``: elements ``[dest, dest + numel)`` of the flattened logical tensor are
elements ``[offset, offset + numel)`` of an array. Row blocks (FSDP2 ``Shard(0)``) are
contiguous in row-major order, so a shard starting at row ``row_start`` lands at
``dest = row_start * (elements per row)``.

Tables are added one rank at a time, when a read first needs one of that rank's rows (a
rank loading at the same world size reads its own table, not all of them), and only one
rank's parsed JSON is alive at once. Each shard must sit where the tensor table's row split
puts it (the rank's block of a split tensor; row 0 of one every rank holds whole), and
every tensor the split gives rows on a rank must have a shard there: so the ranks' blocks
tile each tensor exactly, whichever ranks were read.

A tensor the tensor table lists by ``boxes_per_rank`` has box shards (``start``,
``shape``): each must be the table's box for its rank, and becomes one ``Placement`` whose
``dest`` is the box's first element and whose ``box`` says how its elements lie in the
tensor.
"""

from __future__ import annotations

import bisect
import math

from ...layout.box_runs import first_element
from ...errors import UsageError
from ..errors import CheckpointError
from .bounds import RowSplit
from .tensor_table import Manifest, Placement

_EMPTY: dict = {}
_new_placement = tuple.__new__  # Placement without the namedtuple constructor's frame


class ShardTables:
    """The placements of every (tensor, state) from the ranks' tables added so far."""

    def __init__(self, manifest: Manifest):
        self.m = manifest
        self._tensors = {t.name: t for t in manifest.tensors}
        self._row_numel = {t.name: math.prod(t.shape[1:]) for t in manifest.tensors}
        self._numels = {n: a.numel for n, a in manifest.arrays.items()}
        # each placement refers to the manifest's own name string of its array, not to a
        # copy parsed from every shard entry (200,000 strings at 100,000 tensors, W=2)
        self._array_names = {n: n for n in manifest.arrays}
        self._dtypes = {n: a.dtype for n, a in manifest.arrays.items()}
        self._placements: dict[tuple[str, str], list] = {}
        self.ranks: set[int] = set()   # ranks added
        # The states whose placements are kept (None: all). Every state is checked either
        # way; a reader that needs one state of 100,000 tensors keeps a third of the tuples.
        self.kept_states: frozenset[str] | None = None
        self._starts: dict[str, list[int] | None] = {}  # tensor -> expected first row per rank

    def expected_start(self, name: str, rank: int) -> int:
        """The first row of ``name`` that rank ``rank`` holds, by the tensor table: its
        block of the row split, or 0 where every holding rank holds the whole tensor."""
        starts = self._starts.get(name)
        if name not in self._starts:
            counts = self.m.rows[name]
            t = self._tensors[name]
            rows = t.shape[0] if t.shape else 1
            starts = None
            if isinstance(counts, RowSplit):  # the FSDP2 split: no list of world_size starts
                return counts.start(rank)
            if sum(counts) == rows:
                starts, pos = [], 0
                for c in counts:
                    starts.append(pos)
                    pos += c
            self._starts[name] = starts
        return 0 if starts is None else starts[rank]

    def ranks_for(self, name: str, lo_row: int, hi_row: int) -> list[int]:
        """The held ranks whose rows of ``name`` overlap rows ``[lo_row, hi_row)``."""
        boxes = self.m.boxes.get(name)
        if boxes is not None:
            return [r for r in self.m.ranks if boxes[r] is not None and math.prod(boxes[r][1])
                    and (not boxes[r][0] or (boxes[r][0][0] < hi_row
                                             and lo_row < boxes[r][0][0] + boxes[r][1][0]))]
        counts = self.m.rows[name]
        out = []
        for r in self.m.ranks:
            start = self.expected_start(name, r)
            if counts[r] and start < hi_row and lo_row < start + counts[r]:
                out.append(r)
        return out

    def keep_only(self, states) -> None:
        """Keep the placements of ``states`` alone from the tables added from now on (the
        others are still checked). Before any table is added; ``keep_all`` undoes it."""
        if self.ranks:
            raise UsageError("ShardTables.keep_only: tables were added already")
        self.kept_states = frozenset(states)

    def keeps(self, state: str) -> bool:
        return self.kept_states is None or state in self.kept_states

    def keep_all(self) -> None:
        """Forget what was added and keep every state from now on (the tables are then
        added again as reads need them)."""
        self._placements.clear()
        self.ranks.clear()
        self.kept_states = None

    def placements(self, name: str, state: str) -> list[Placement]:
        """The placements of ``name``'s ``state`` from the ranks added, sorted by ``dest``."""
        return self._placements.get((name, state), [])

    def all_placements(self) -> dict[tuple[str, str], list[Placement]]:
        return self._placements

    def add(self, rank: int, doc, where: str) -> None:
        """Rank ``rank``'s table, read from ``where`` (named in errors): ``{tensor: shard}``
        or its ``(tensor, shard)`` pairs (parsed one at a time: a table of 100,000 tensors
        is then never whole in memory). The checks run on every shard, so they are written
        for speed. On any error nothing of the rank is kept (the tables added before are)."""
        if type(doc) is dict:
            doc = doc.items()
        elif isinstance(doc, (str, bytes, list)) or not hasattr(doc, "__iter__"):
            raise CheckpointError(f"{where}: 'shards' must be an object {{tensor: shard}}")
        try:
            self._add(rank, doc, where)
        except BaseException:
            self._drop_rank(rank)
            raise
        self.ranks.add(rank)

    def _drop_rank(self, rank: int) -> None:
        for key, acc in list(self._placements.items()):
            acc[:] = [p for p in acc if p.rank != rank]
            if not acc:
                del self._placements[key]

    def _add(self, rank: int, pairs, where: str) -> None:
        tensors, numels, dtypes = self._tensors, self._numels, self._dtypes
        rows_of, placements, boxes_of = self.m.rows, self._placements, self.m.boxes
        kept, array_names = self.kept_states, self._array_names
        seen: set[str] = set()   # the tensor table's own name strings: a set of references
        for name, shard in pairs:
            t = tensors.get(name)
            if t is None:
                raise CheckpointError(f"{where}: tensor {name!r} has a shard on rank {rank} but is "
                                      f"not in the tensor table")
            if t.name in seen:
                raise CheckpointError(f"{where}: tensor {name!r} has two shards on rank {rank}")
            seen.add(t.name)
            if type(shard) is not dict:
                raise CheckpointError(f"{where}: tensor {name!r}: the shard must be an object")
            box = None
            if boxes_of and name in boxes_of:
                box, numel = _box_of(shard, boxes_of[name][rank], where, name, rank)
                dest = first_element(t.shape, box[0])
            else:
                numel, dest = self._rows_of(shard, where, name, rank)
            states = shard.get("states", _EMPTY)
            if type(states) is not dict or states.keys() != t.states.keys():
                raise CheckpointError(_bad_states(where, name, rank, states, t.states))
            for state, ref in states.items():
                try:
                    array, offset = ref["array"], ref["offset"]
                    limit = numels[array]
                except (KeyError, TypeError):
                    raise CheckpointError(_bad_ref(where, name, rank, state, ref, numel,
                                                   numels)) from None
                if type(offset) is not int or offset < 0 or offset + numel > limit:
                    raise CheckpointError(_bad_ref(where, name, rank, state, ref, numel, numels))
                if dtypes[array] != t.states[state].dtype:
                    raise CheckpointError(f"{where}: tensor {name!r}, rank {rank}, state {state!r}: "
                                          f"array {array!r} holds {dtypes[array]}, the tensor table "
                                          f"says {t.states[state].dtype}")
                if not numel or (kept is not None and state not in kept):
                    continue
                acc = placements.get((name, state))
                if acc is None:
                    acc = placements[(name, state)] = []
                bisect.insort(acc, _new_placement(Placement, (dest, numel, array_names[array],
                                                              offset, rank, box)))
        for t in self.m.tensors:
            n = rows_of[t.name][rank]
            if n and t.name not in seen:
                if t.name in boxes_of:
                    raise CheckpointError(f"{where}: tensor {t.name!r}: rank {rank}'s box is in "
                                          f"no shard (its shard table has no entry; the tensor "
                                          f"table gives it {n} elements)")
                start = self.expected_start(t.name, rank)
                raise CheckpointError(f"{where}: tensor {t.name!r}: rows [{start}, {start + n}) "
                                      f"are in no shard (rank {rank}'s shard table has no entry; "
                                      f"the tensor table gives it {n} rows)")

    def _rows_of(self, shard: dict, where: str, name: str, rank: int) -> tuple[int, int]:
        """(elements, first element in the tensor) of a shard of rows, checked."""
        try:
            row_start, nrows, numel = shard["row_start"], shard["rows"], shard["numel"]
        except KeyError as e:
            raise CheckpointError(f"{where}: tensor {name!r}: a shard has no {e.args[0]!r}") from None
        if not (type(row_start) is int and type(nrows) is int and type(numel) is int
                and row_start >= 0 and nrows >= 0 and numel >= 0):
            raise CheckpointError(f"{where}: tensor {name!r}: a shard's row_start, rows and "
                                  f"numel must be integers >= 0, got {row_start!r}, "
                                  f"{nrows!r}, {numel!r}")
        row_numel = self._row_numel[name]
        if numel != nrows * row_numel:
            raise CheckpointError(f"{where}: tensor {name!r}, rank {rank}: numel {numel} is not "
                                  f"rows {nrows} x {row_numel} elements per row")
        expected = self.m.rows[name][rank]
        if nrows != expected:
            raise CheckpointError(f"{where}: tensor {name!r}: rank {rank} holds {nrows} rows, "
                                  f"the tensor table says {expected}")
        if nrows and row_start != self.expected_start(name, rank):
            raise CheckpointError(f"{where}: tensor {name!r}: rank {rank}'s shard starts at row "
                                  f"{row_start}, the tensor table's row split puts it at row "
                                  f"{self.expected_start(name, rank)}")
        return numel, row_start * row_numel


def _box_of(shard: dict, want, where: str, name: str, rank: int) -> tuple[tuple, int]:
    """((start, shape), elements) of a box shard, checked to be the tensor table's box of
    ``rank`` (``want``: (start, shape), or None where the table gives the rank none)."""
    start, shape = shard.get("start"), shard.get("shape")
    if want is None or type(start) is not list or type(shape) is not list \
            or (tuple(start), tuple(shape)) != want:
        raise CheckpointError(f"{where}: tensor {name!r}: rank {rank}'s shard is the box "
                              f"start={start!r:.100} shape={shape!r:.100}, the tensor table's "
                              f"boxes_per_rank gives it " + ("none" if want is None else
                              f"start={list(want[0])} shape={list(want[1])}"))
    numel = math.prod(want[1])
    if shard.get("numel") != numel:
        raise CheckpointError(f"{where}: tensor {name!r}, rank {rank}: numel "
                              f"{shard.get('numel')!r} is not the {numel} elements of its box")
    return want, numel


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
