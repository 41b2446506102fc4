"""NVMe bytes per step, I/O time at a measured bandwidth, all_to_all bytes, drive writes per day.

The store's steady state (docs/store.md, "How buckets move"): with ``alternate_order`` the
schedule is reversed every step and eviction follows next use, so the buckets still
cached when a step ends are the first ones the next step uses. Each step therefore reads
exactly the NVMe buckets that were not resident when it began, once each, and writes back
every bucket except those that stay cached for the next step (what the next step reads).
Which buckets stay cached depends on what ZeroMuon holds while others are evicted, so it
is found by replaying the step (``step_sim``). Forward-order and reversed-order steps can
differ, so both are given. The first step differs (buckets never written are zero-filled).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..io.align import round_up
from .memory import ArrayPlan, RankState
from .step_sim import steady_state

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
    def written_mean(self) -> float:
        return sum(self.written) / 2


def step_io(st: RankState, homes: dict[str, str], cpu_budget: int,
            prefetch_depth: int = 2) -> StepIO:
    """NVMe bytes one rank reads and writes per step with pool ``cpu_budget`` bytes."""
    arrays: dict[str, ArrayPlan] = st.arrays
    nvme = {n: a for n, a in arrays.items() if homes.get(n) == "nvme"}
    total = sum(a.nbytes for a in nvme.values())
    room = round_up(cpu_budget) - sum(a.pinned_bytes for n, a in arrays.items()
                                      if homes.get(n) == "cpu")
    if not nvme or sum(a.pinned_bytes for a in nvme.values()) <= room:
        # everything stays cached after the first step
        return StepIO(read=(0, 0), written=(0, 0), resident=(total, total), nvme_state=total)
    read, written, resident = steady_state(st.layout, arrays, homes, cpu_budget, prefetch_depth)
    return StepIO(read=read, written=written, resident=resident, nvme_state=total)


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
