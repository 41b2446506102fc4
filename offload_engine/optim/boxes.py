"""Boxes: the rectangle of a parameter's global tensor that one rank holds.

A DTensor placement on a 1-D or 2-D device mesh (FSDP2's ``Shard(0)``, HSDP's
``(Replicate(), Shard(0))``, FSDP + tensor parallel's ``(_StridedShard(0), Shard(0))`` or
``(Shard(0), Shard(1))``, a replicated norm) leaves each rank one box of the global tensor:
an index range ``[lo[d], hi[d])`` per dimension. The rank's local tensor is that box, and
its flat form (what ZeroMuon's state arrays and buffers hold) is the box in row-major order:
global element ``(i, j)`` of a matrix sits at flat position
``(i - lo[0]) * (hi[1] - lo[1]) + (j - lo[1])`` of the holder's local tensor.

FSDP2's row split on a 1-D mesh is the special case ``lo = (row_start, 0)``,
``hi = (row_start + rows, cols)``: the flat local tensor is then rows ``[row_start,
row_start + rows)`` of the flattened matrix, as it always was.

Several ranks hold the same box where a mesh dimension replicates the tensor (HSDP
replicas, tensor-parallel ranks of a norm). Newton-Schulz needs every distinct box once:
``sources`` picks, for a matrix's owner, one holder of each box.

Pure: no torch, so the planner can use it too.
"""

from __future__ import annotations

import math
from typing import NamedTuple
from ..errors import InputError


class Box(NamedTuple):
    """Index ranges ``[lo[d], hi[d])`` of a tensor, one per dimension (``()`` for 0-d)."""

    lo: tuple[int, ...]
    hi: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        """The local tensor's shape."""
        return tuple(h - l for l, h in zip(self.lo, self.hi))

    @property
    def numel(self) -> int:
        """Elements in the box (1 for a 0-d tensor, 0 for an empty box)."""
        return math.prod(self.shape)

    def slices(self) -> tuple[slice, ...]:
        """Index the global tensor with these to get the box."""
        return tuple(slice(l, h) for l, h in zip(self.lo, self.hi))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{l}:{h}" for l, h in zip(self.lo, self.hi)) + "]"


def full_box(shape) -> Box:
    """All of a tensor of ``shape``."""
    return Box((0,) * len(shape), tuple(shape))


def row_box(shape, row_start: int, rows: int) -> Box:
    """Rows ``[row_start, row_start + rows)`` of a tensor of ``shape``, every column."""
    if not shape:
        return Box((), ())
    return Box((row_start, *(0,) * (len(shape) - 1)), (row_start + rows, *shape[1:]))


def row_counts(shape, boxes: list[Box]) -> list[int] | None:
    """The rows each rank holds if ``boxes`` are a row split (FSDP2 ``Shard(0)`` on a 1-D
    mesh: whole rows, in rank order, each row held once); else None."""
    if not shape:                      # a 0-d tensor is one row, held by a single rank
        return [1] if len(boxes) == 1 else None
    start, rows = 0, []
    for b in boxes:
        n = b.hi[0] - b.lo[0]
        if n and (b.lo[0] != start or b.lo[1:] != (0,) * (len(shape) - 1)
                  or b.hi[1:] != tuple(shape[1:])):
            return None
        start += n
        rows.append(n)
    return rows if start == shape[0] else None


def check_tiling(shape, boxes: list[Box], what: str) -> None:
    """Raise ValueError unless the distinct non-empty ``boxes`` cover a tensor of ``shape``
    exactly once (replicas hold equal boxes; different boxes must not overlap)."""
    distinct = sorted({b for b in boxes if b.numel})
    for b in distinct:
        if len(b.lo) != len(shape) or any(l < 0 or h > s for l, h, s in zip(b.lo, b.hi, shape)):
            raise InputError(f"{what}: a rank holds {b}, outside its shape {tuple(shape)}")
    for i, a in enumerate(distinct):
        for b in distinct[i + 1:]:
            if all(max(al, bl) < min(ah, bh) for al, ah, bl, bh in zip(a.lo, a.hi, b.lo, b.hi)):
                raise InputError(f"{what}: ranks hold overlapping blocks {a} and {b}")
    if sum(b.numel for b in distinct) != math.prod(shape):
        raise InputError(f"{what}: the blocks the ranks hold ({', '.join(map(str, distinct))}) "
                         f"do not cover its shape {tuple(shape)}")


def replica_index(boxes: list[Box], rank: int) -> int:
    """How many lower ranks hold the same box as ``rank``: 0 for the first copy."""
    mine = boxes[rank]
    return sum(1 for b in boxes[:rank] if b == mine)


def first_copies(boxes: list[Box]) -> list[Box | None]:
    """Each distinct non-empty box once, at the lowest rank holding it; None for every other
    rank. Under HSDP that is replica 0's shard group (the ranks of one replica come before
    the next's), whose copy the other replicas repeat: what a checkpoint saves."""
    seen: set[Box] = set()
    out: list[Box | None] = []
    for b in boxes:
        out.append(b if b.numel and b not in seen else None)
        seen.add(b)
    return out


def sources(boxes: list[Box], owner: int) -> list[bool]:
    """``out[g]``: rank ``g`` sends its box to ``owner`` (each distinct non-empty box once).

    The owner sends nothing for a box it holds itself. Any other box comes from its holder
    with the owner's replica index (modulo the number of holders): under HSDP that is the
    rank of the owner's own replica (its shard group, inside a node), and owners spread
    over replicas spread the sending over them too.

    An owner with an empty box (fewer rows than shards) has no replica index of its own:
    equal empty boxes of one replica would count as copies. Its replica is then taken from
    its position, ``owner * holders // ranks``: HSDP numbers ranks replica by replica, so
    this is the replica the owner sits in."""
    world = len(boxes)
    k = replica_index(boxes, owner) if boxes[owner].numel else None
    holders: dict[Box, list[int]] = {}
    for g, b in enumerate(boxes):
        if b.numel:
            holders.setdefault(b, []).append(g)
    out = [False] * world
    for b, hs in holders.items():
        if owner in hs:
            out[owner] = True
        elif k is not None:
            out[hs[k % len(hs)]] = True
        else:
            out[hs[owner * len(hs) // world]] = True
    return out
