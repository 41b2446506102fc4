"""Muon's unit of work: one 2-D matrix, a 2-D parameter or one expert of a stack.

A Muon parameter is either a matrix (2-D) or a **stack of expert matrices** (3-D,
``[num_experts, out, in]``, dim 0 the expert: ``param_rules.is_expert_stack``). Momentum
and the Nesterov input are elementwise, so they run on a rank's whole local box of either;
Newton-Schulz and the lr adjustment are per matrix: each expert of a stack is
orthogonalized on its own, with its own (out, in) shape, exactly as ``torch.optim.Muon``
on that expert's slice as a 2-D parameter.

Each rank holds one box of a parameter (``boxes.py``). For a stack that box is
``[e0:e1, r0:r1, c0:c1]``, so it holds the 2-D box ``[r0:r1, c0:c1]`` of each expert
``e0 <= e < e1``, stored at element ``(e - e0) * (r1 - r0) * (c1 - c0)`` of its flat local
tensor (row-major). ``matrices_of`` lists every matrix with the 2-D box each rank holds of
it and where that box starts in the rank's flat local tensor; the exchange (``comm.py``)
and the owners (``owners.py``) work on these.

An expert one rank holds whole and no other rank holds any of (expert parallelism), and
every matrix of a world of one, is **kept**: that rank orthogonalizes it where it is,
with no exchange. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from .boxes import Box, full_box, row_box

EMPTY = Box((0, 0), (0, 0))


@dataclass(frozen=True)
class Matrix:
    """One matrix of a Muon parameter and the part of it each rank holds."""

    param: int                 # ParamInfo.index
    expert: int                # index on dim 0 of a stack; 0 for a 2-D parameter
    rows: int
    cols: int
    boxes: tuple[Box, ...]     # each rank's 2-D box of it (EMPTY where it holds none)
    starts: tuple[int, ...]    # where that box starts in the rank's flat local tensor
    stacked: bool = False      # an expert of a 3-D stack

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def holders(self) -> list[int]:
        """Ranks that hold a non-empty part of it."""
        return [g for g, b in enumerate(self.boxes) if b.numel]

    @property
    def kept(self) -> bool:
        """One rank holds all of it and no other rank any of it: orthogonalized there. At
        world size 1 every matrix; across ranks only experts of a stack (a 2-D parameter keeps
        the owner rule the planner replays, even when one rank holds all its rows)."""
        hs = self.holders
        if len(self.boxes) > 1 and not self.stacked:
            return False
        return len(hs) == 1 and self.boxes[hs[0]] == full_box((self.rows, self.cols))

    @property
    def candidates(self) -> list[int] | None:
        """The ranks that may orthogonalize it (``owners.assign_owners``): an expert's
        holders, so it never travels outside them; None (any rank) for a 2-D parameter."""
        return self.holders if self.stacked else None

    @property
    def keeper(self) -> int | None:
        """The rank that holds a kept matrix (None when it is exchanged)."""
        return self.holders[0] if self.kept else None


def param_boxes(info, world: int) -> list[Box]:
    """The box of every rank (row splits with one running offset: linear in ``world``)."""
    if info.boxes is not None:
        return info.boxes
    out, start = [], 0
    for g in range(world):
        n = info.rows_per_rank[g]
        out.append(row_box(info.shape, start, n))
        start += n
    return out


def matrices_of(info, world: int, distributed: bool = True) -> list[Matrix]:
    """The matrices of Muon parameter ``info``: one for a 2-D parameter, one per expert of a
    stack, with every rank's box of each. Not distributed (a plain tensor, or world 1): this
    rank holds every matrix whole, as rank 0 of a world of one."""
    rows, cols = info.matrix_shape
    if not distributed or world == 1:
        whole = full_box((rows, cols))
        return [Matrix(info.index, e, rows, cols, (whole,), (e * rows * cols,))
                for e in range(info.matrices)]
    boxes = param_boxes(info, world)
    if not info.stacked:
        return [Matrix(info.index, 0, rows, cols, tuple(boxes), (0,) * world)]
    out = []
    for e in range(info.matrices):
        mine, starts = [], []
        for b in boxes:
            if b.numel and b.lo[0] <= e < b.hi[0]:
                box2 = Box(b.lo[1:], b.hi[1:])
                mine.append(box2)
                starts.append((e - b.lo[0]) * box2.numel)
            else:
                mine.append(EMPTY)
                starts.append(0)
        out.append(Matrix(info.index, e, rows, cols, tuple(mine), tuple(starts), True))
    return out
