"""Where an imported tensor's rows go in a target rank's arrays (pure: no torch, no I/O).

Every array of an imported generation is *packed*, as ``save_checkpoint`` packs
parameters: a rank's rows of each tensor back to back, in tensor order, one array per
state kind and dtype. Nothing is kept per tensor: the shard table and each array's
contents are generated again from the plans when they are written (a pass over 100,000
tensors takes a fraction of a second; holding them cost kilobytes each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

from ..dtypes import DType
from ..layout.manifest import array_name, fsdp_rows, shard_entry, tensor_rows
from .import_plan import StatePlan, TensorPlan


def rows_per_rank(plan: TensorPlan, world: int) -> tuple[int, ...]:
    """Rows each target rank holds: FSDP2 ``Shard(0)`` for parameters (what ZeroMuon over
    an FSDP2 model keeps), all on rank 0 for buffers (as ``save_checkpoint`` saves them)."""
    rows = tensor_rows(plan.shape)
    if plan.kind == "buffer":
        return (rows,) + (0,) * (world - 1)
    return fsdp_rows(rows, world)


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements ``[first, first + count)`` of ``plan``'s state ``state`` (of its flattened
    elements, as the source numbers them) are the next ``count`` elements of an array."""

    plan: TensorPlan
    state: StatePlan
    first: int
    count: int


class RankLayout:
    """Rank ``rank``'s arrays among ``world`` ranks: ``arrays`` ``{name: (DType,
    elements)}`` in the order their first tensor lists them."""

    def __init__(self, plans: list[TensorPlan], rank: int, world: int):
        self.plans = plans
        self.rank = rank
        self.world = world
        self._names: dict[tuple[bool, int], str] = {}
        self.arrays: dict[str, tuple[DType, int]] = {}
        for plan, _row_start, _rows, numel in self._held():
            for state in plan.states:
                name = self.array_of(plan, state)
                dtype, used = self.arrays.get(name, (state.dtype, 0))
                self.arrays[name] = (dtype, used + numel)

    def array_of(self, plan: TensorPlan, state: StatePlan) -> str:
        """The array that holds ``state`` of ``plan`` on this rank."""
        # by the state's identity (StatePlans are shared, import_plan._state): hashing the
        # dataclasses was a tenth of the writer's time at 100,000 tensors
        key = (plan.kind == "buffer", id(state))
        name = self._names.get(key)
        if name is None:
            kind = "buffer" if plan.kind == "buffer" else state.key
            name = self._names[key] = array_name(self.rank, kind, state.dtype)
        return name

    def _held(self) -> Iterator[tuple[TensorPlan, int, int, int]]:
        """``(plan, row start, rows, elements)`` of every tensor this rank holds rows of."""
        for plan in self.plans:
            held = rows_per_rank(plan, self.world)
            rows = held[self.rank]
            if rows:
                per_row = math.prod(plan.shape[1:]) if len(plan.shape) > 1 else 1
                yield plan, sum(held[:self.rank]), rows, rows * per_row

    def shard_entries(self) -> Iterator[tuple[str, dict]]:
        """``(tensor name, shard entry)`` of every tensor this rank holds rows of, in
        tensor order: the shard table, one entry at a time."""
        used = dict.fromkeys(self.arrays, 0)
        for plan, row_start, rows, numel in self._held():
            where = {}
            for state in plan.states:
                name = self.array_of(plan, state)
                where[state.key] = (name, used[name])
                used[name] += numel
            yield plan.name, shard_entry(row_start, rows, numel, where)

    def pieces(self, array: str) -> Iterator[Piece]:
        """What array ``array`` holds, in element order."""
        for plan, row_start, rows, numel in self._held():
            for state in plan.states:
                if self.array_of(plan, state) == array:
                    yield Piece(plan, state, numel // rows * row_start, numel)


def held_anywhere(plan: TensorPlan, world: int) -> bool:
    """Whether some rank holds a row of ``plan`` (a tensor of no rows is held by none)."""
    return any(rows_per_rank(plan, world))
