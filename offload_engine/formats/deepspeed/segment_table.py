"""Where every (tensor, state) of a DeepSpeed checkpoint lies in its files, in compact arrays.

A ZeRO-3 run of a mixture-of-experts model has 50,000-100,000 parameters, each with up to
four states (``master``, ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``) split over every
rank: a Python object per (tensor, state, rank) cost kilobytes per tensor. Here a segment
is four 8-byte integers (element start, element count, file number, byte offset) in flat
``array('q')`` columns; a (tensor, state) is a range of them, found through two per-state
columns indexed by tensor number (one dict maps names to numbers). About 40 bytes per
segment and 17 bytes per (tensor, state), whatever the tensor count.
"""

from __future__ import annotations

import bisect
from array import array

from ...errors import InputError
from .scatter_read import Segment, Want


class _StateColumns:
    """Per tensor number: its first and end segment (-1: the tensor has no such state) and
    its bytes per element."""

    __slots__ = ("first", "end", "itemsize")

    def __init__(self):
        self.first = array("q")
        self.end = array("q")
        self.itemsize = array("b")

    def grow(self, count: int) -> None:
        missing = count - len(self.first)
        if missing > 0:
            self.first.extend([-1] * missing)
            self.end.extend([-1] * missing)
            self.itemsize.extend([0] * missing)


class SegmentTable:
    """Segments of every (tensor, state), sorted by element start within each."""

    def __init__(self):
        self._number: dict[str, int] = {}
        self._states: dict[str, _StateColumns] = {}
        self._start = array("q")
        self._count = array("q")
        self._file = array("q")
        self._offset = array("q")

    def __contains__(self, key: tuple[str, str]) -> bool:
        return self.lookup(*key) is not None

    def has_tensor(self, name: str) -> bool:
        """Whether any state of ``name`` was added."""
        return name in self._number and any(
            self.lookup(name, s) is not None for s in self._states)

    def add(self, name: str, state: str, segments: list[Segment], itemsize: int) -> None:
        """Record ``state`` of ``name`` (``segments`` in any order; added once)."""
        number = self._number.setdefault(name, len(self._number))
        cols = self._states.setdefault(state, _StateColumns())
        cols.grow(number + 1)
        first = len(self._start)
        for seg in sorted(segments, key=lambda s: s.start):
            self._start.append(seg.start)
            self._count.append(seg.count)
            self._file.append(seg.file)
            self._offset.append(seg.offset)
        cols.first[number], cols.end[number] = first, len(self._start)
        cols.itemsize[number] = itemsize

    def forget(self, state: str) -> None:
        """Drop ``state`` for every tensor (its segments stay in the columns, unused)."""
        self._states.pop(state, None)

    def lookup(self, name: str, state: str) -> tuple[int, int, int] | None:
        """``(first segment, end segment, bytes per element)`` of ``state`` of ``name``, or
        None when it has none."""
        number = self._number.get(name)
        cols = self._states.get(state)
        if number is None or cols is None or number >= len(cols.first) or cols.first[number] < 0:
            return None
        return cols.first[number], cols.end[number], cols.itemsize[number]

    def wants(self, found: tuple[int, int, int], lo: int, dest: memoryview, what: str) -> list[Want]:
        """The reads that fill ``dest`` (bytes) with elements ``[lo, lo + len(dest) //
        itemsize)`` of the (tensor, state) ``found`` (what ``lookup`` gave). InputError
        naming ``what`` when the range runs past the tensor."""
        first, end, itemsize = found
        if len(dest) % itemsize:
            raise InputError(f"{what}: a buffer of {len(dest)} bytes holds no whole number of "
                             f"{itemsize}-byte elements")
        hi = lo + len(dest) // itemsize
        wants = []
        pos = lo
        i = max(first, bisect.bisect_right(self._start, lo, first, end) - 1)
        while pos < hi and i < end:
            start, count = self._start[i], self._count[i]
            i += 1
            if start + count <= pos:
                continue
            take = min(hi, start + count) - pos
            wants.append(Want(self._file[i - 1], self._offset[i - 1] + (pos - start) * itemsize,
                              dest[(pos - lo) * itemsize:(pos - lo + take) * itemsize]))
            pos += take
        if pos < hi:
            raise InputError(f"{what}: elements [{lo}, {hi}) are out of range")
        return wants
