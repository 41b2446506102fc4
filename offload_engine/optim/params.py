"""One parameter as the optimizer sees it: shape, kind, and the rows each rank holds.

Pure data (no torch import): the state layout, the owners of Muon matrices and the
planner all work from these, and the planner builds them from shapes alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


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
    distributed: bool          # a Shard(0) DTensor (on a mesh of any size); else held whole
    rows_per_rank: list[int] = field(default_factory=list)

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

    def local_numel(self, rank: int) -> int:
        return self.rows_per_rank[rank] * self.row_numel

    def row_offset(self, rank: int) -> int:
        return sum(self.rows_per_rank[:rank])
