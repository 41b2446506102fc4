"""NVMe bytes per step, I/O time at a measured bandwidth, all_to_all bytes, drive writes per day.

The store's steady state (docs/store.md, "How buckets move"): with ``alternate_order`` the
schedule is reversed every step and eviction follows next use, so the buckets still
cached when a step ends are the first ones the next step uses. Each step therefore reads,
and writes back, exactly the NVMe buckets that were not resident when it began, once each.
Resident at a step's start: the longest run of buckets at the end of the previous step's
order whose page-rounded sizes fit in the pool next to the arrays homed on ``cpu``. With
buckets of unequal size the two directions can differ, so even and odd steps are given
separately. The first step differs (buckets never written are zero-filled, not read).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..io.align import round_up
from .memory import ArrayPlan, RankState

DAY_S = 86400.0


@dataclass
class StepIO:
    """Per rank, per step, steady state. Bytes."""

    read: tuple[int, int]      # (forward-order step, reversed-order step)
    written: tuple[int, int]
    resident: tuple[int, int]  # NVMe bucket bytes cached at the start of each kind of step
    nvme_state: int            # bytes of all NVMe-home buckets (what one pass moves)

    @property
    def read_max(self) -> int:
        return max(self.read)

    @property
    def written_max(self) -> int:
        return max(self.written)

    @property
    def read_mean(self) -> float:
        return sum(self.read) / 2

    @property
    def written_mean(self) -> float:
        return sum(self.written) / 2


def step_io(st: RankState, homes: dict[str, str], cpu_budget: int) -> StepIO:
    """NVMe bytes one rank reads and writes per step with pool ``cpu_budget`` bytes."""
    arrays: dict[str, ArrayPlan] = st.arrays
    pinned_home = sum(a.pinned_bytes for n, a in arrays.items() if homes.get(n) == "cpu")
    room = round_up(cpu_budget) - pinned_home
    buckets = {n: a.buckets() for n, a in arrays.items() if homes.get(n) == "nvme"}
    sizes = [buckets[name][b] for name, b in st.order() if name in buckets]
    total = sum(sizes)
    # a step in forward order starts with what the reversed step before it left: its tail,
    # i.e. the head of the forward order; a reversed step starts with the forward tail.
    head = _fit(sizes, room)
    tail = _fit(sizes[::-1], room)
    return StepIO(read=(total - head, total - tail), written=(total - head, total - tail),
                  resident=(head, tail), nvme_state=total)


def _fit(sizes: list[int], room: int) -> int:
    used = got = 0
    for s in sizes:
        if used + round_up(s) > room:
            break
        used += round_up(s)
        got += s
    return got


def io_seconds(read_bytes: float, write_bytes: float, read_bps: float | None,
               write_bps: float | None) -> float | None:
    """Time to move the bytes on a device shared by reads and writes (bytes/s)."""
    if not read_bps or not write_bps:
        return None
    return read_bytes / read_bps + write_bytes / write_bps


def drive_writes_per_day(write_bytes_per_step: float, step_s: float | None,
                         capacity_bytes: int | None) -> float | None:
    """Full-drive writes per day for a node writing ``write_bytes_per_step`` every
    ``step_s`` seconds to drives of ``capacity_bytes`` in all."""
    if not step_s or not capacity_bytes:
        return None
    return write_bytes_per_step * (DAY_S / step_s) / capacity_bytes
