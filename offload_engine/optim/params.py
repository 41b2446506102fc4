"""One parameter as the optimizer sees it: shape, kind, and the part each rank holds.

Pure data (no torch import): the state layout, the owners of Muon matrices and the
planner all work from these, and the planner builds them from shapes alone.

What each rank holds is written one of two ways: ``rows_per_rank`` for a row split
(FSDP2 ``Shard(0)`` on a 1-D mesh, a tensor held whole, and everything the planner lays
out), or ``boxes`` (one ``boxes.Box`` per rank) for every other placement (HSDP, tensor
parallel, replicated DTensors). ``box(rank)`` answers for both, so the exchange, the
state layout and checkpoints have one code path; the row form stays because most runs are
row splits, which manifests record as rows (docs/format.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .boxes import Box, row_box


@dataclass(eq=False)
class ParamInfo:
    """One parameter as the optimizer sees it. Shapes are global."""

    index: int                 # position over all groups, as in torch's state_dict
    param: object              # the torch.Tensor (a DTensor under FSDP2); None when planning
    group: dict
    name: str | None
    kind: str                  # "muon" | "adamw"
    shape: tuple[int, ...]
    dtype: object              # a torch dtype or an ``offload_engine.dtypes`` name or DType
    distributed: bool          # a DTensor (on a mesh of any size); else held whole
    rows_per_rank: list[int] = field(default_factory=list)  # a row split: rows of each rank
    boxes: list[Box] | None = None   # any other split: each rank's box (rows_per_rank unused)
    placement: str = ""        # how it is split, for messages, e.g. "(Replicate(), Shard(dim=0))"

    @property
    def row_numel(self) -> int:
        """Elements per row: the product of the dimensions after the first."""
        return math.prod(self.shape[1:])

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def numel(self) -> int:
        return self.rows * self.row_numel

    @property
    def stacked(self) -> bool:
        """A stack of matrices on dim 0: a 3-D Muon parameter, one matrix per expert
        (``matrices.py``)."""
        return self.kind == "muon" and len(self.shape) == 3

    @property
    def matrices(self) -> int:
        """How many matrices Newton-Schulz sees in it: the experts of a stack, else 1."""
        return self.shape[0] if self.stacked else 1

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """(rows, cols) of each matrix: an expert's slice of a stack, else (rows, elements
        per row); Muon's lr adjustment and Newton-Schulz cost come from it."""
        return tuple(self.shape[1:]) if self.stacked else (self.rows, self.row_numel)

    @property
    def row_split(self) -> bool:
        """Each rank holds whole rows, in rank order, each row once (no ``boxes``)."""
        return self.boxes is None

    @property
    def ranks(self) -> int:
        """How many ranks the split lists."""
        return len(self.rows_per_rank) if self.boxes is None else len(self.boxes)

    def box(self, rank: int) -> Box:
        """The part of the global tensor ``rank`` holds (its local tensor, row-major)."""
        if self.boxes is not None:
            return self.boxes[rank]
        return row_box(self.shape, self.row_offset(rank), self.rows_per_rank[rank])

    def local_numel(self, rank: int) -> int:
        """Elements ``rank`` holds."""
        if self.boxes is not None:
            return self.boxes[rank].numel
        return self.rows_per_rank[rank] * self.row_numel

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of the local tensor of ``rank``."""
        if self.boxes is not None:
            return self.boxes[rank].shape
        return (self.rows_per_rank[rank], *self.shape[1:]) if self.shape else ()

    def row_offset(self, rank: int) -> int:
        """First row ``rank`` holds; only for a row split (a box has no first row of its own)."""
        self.require_row_split("a first row")
        return sum(self.rows_per_rank[:rank])

    def require_row_split(self, what: str) -> None:
        """Raise NotImplementedError (naming the parameter and its placement) unless each rank
        holds whole rows in rank order, which ``what`` needs."""
        if self.boxes is not None:
            raise NotImplementedError(
                f"parameter {self.name or self.index} has placement {self.placement or 'boxes'}"
                f": {what} needs FSDP2's Shard(0) on a 1-D mesh (each rank a block of rows); "
                "other placements (HSDP, tensor parallel, replicated DTensors) hold boxes: use "
                "box(rank)")
