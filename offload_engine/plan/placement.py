"""Where the state goes under the store's policy, and whether it fits.

Placement mirrors what the engine does with a config: ZeroMuon registers every array of a
rank with the config's homes; an array homed on ``cpu`` lives in the pinned pool for good,
one homed on ``nvme`` is cached there a bucket at a time. So the choice is:

- ``cpu`` when the rank's whole state fits the pinned memory a rank can have (no NVMe
  traffic at all); ``cpu_budget`` is then exactly the state, bucket by bucket page-rounded
  (ZeroMuon's own sizing when it is given no store);
- ``nvme`` otherwise: ``cpu_budget`` is what a rank can pin, rounded down to whole buckets
  and capped at the state plus its working room; it must hold ZeroMuon's working set
  (``optim.pool_budget.working_buckets``: the most buckets a step holds at once plus one,
  the optimizer's own check);
- on a CUDA device, ``gpu_budget`` is the staging arena ZeroMuon's acquires need (the same
  number of buckets, as ZeroMuon sizes it when it opens the store itself).

Host memory a rank can pin: 90% of the node's memory (the OS keeps 10%), less
``HOST_PER_RANK`` of ordinary memory for each training process, shared by the ranks of a
node. GPU memory usable: the card less ``max(1 GiB, 5%)`` (CUDA context, allocator).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..io.align import round_up
from ..units import PAGE, GiB
from ..optim.pool_budget import working_buckets  # ZeroMuon's own bound; planner imports it here
from .memory import RankState

HOST_PER_RANK = 4 * GiB        # pageable memory of one training process (torch, CUDA host side)
OS_FRACTION = 0.10             # of the node's memory, left to the OS and page cache
GPU_RESERVE_MIN = 1 * GiB      # CUDA context and allocator slack
GPU_RESERVE_FRACTION = 0.05


def usable_gpu(gpu_mem: int) -> int:
    return gpu_mem - max(GPU_RESERVE_MIN, int(gpu_mem * GPU_RESERVE_FRACTION))


def pinnable_per_rank(cpu_mem: int, ranks_per_node: int, host_other: int = 0) -> int:
    """Bytes one rank may pin: the node's memory less the OS share and every rank's own
    (``HOST_PER_RANK`` plus ``host_other``: parameters, gradients and buffers kept in host
    memory, e.g. with FSDP2's CPUOffloadPolicy)."""
    avail = int(cpu_mem * (1 - OS_FRACTION)) - ranks_per_node * (HOST_PER_RANK + host_other)
    return max(0, avail // ranks_per_node)


def needed_pinned(st: RankState) -> int:
    """Pool bytes for the rank's whole state (ZeroMuon's ``needed``)."""
    return sum(a.pinned_bytes for a in st.arrays.values())


def working_set(st: RankState, bucket_bytes: int) -> int:
    """Pool bytes ZeroMuon requires beyond cpu-homed state when any array is on NVMe."""
    return working_buckets(st.layout) * bucket_bytes


@dataclass
class Placement:
    home: str                  # default_home of the emitted config: "cpu" or "nvme"
    cpu_budget: int            # per rank
    gpu_budget: int            # per rank (CUDA staging arena), 0 on CPU
    needed: int                # pinned bytes for the whole state (max over ranks)
    working: int               # minimal pool with NVMe (max over ranks)
    pinnable: int              # what a rank may pin on this node
    reason: str


def choose(states: list[RankState], *, bucket_bytes: int, cpu_mem: int,
           ranks_per_node: int, nvme_available: bool, device: str, home: str = "auto",
           cpu_budget: int | None = None, staging: int = 0, host_other: int = 0) -> Placement:
    """The store config's homes and budgets for these ranks (one config serves them all)."""
    needed = max(needed_pinned(s) for s in states)
    working = max(working_set(s, bucket_bytes) for s in states)
    pinnable = pinnable_per_rank(cpu_mem, ranks_per_node, host_other)
    if home == "auto":
        if needed <= pinnable or not nvme_available:
            home = "cpu"
            reason = ("the state fits in pinned memory: no NVMe traffic" if needed <= pinnable
                      else "the state does not fit in pinned memory and no NVMe was given")
        else:
            home = "nvme"
            reason = "the state exceeds the pinned memory a rank can have: homed on NVMe"
    else:
        reason = f"home {home} as asked"
    if cpu_budget is None:
        if home == "cpu":
            cpu_budget = max(needed, PAGE)  # a zero-byte budget is not a valid config
        else:
            fit = pinnable // bucket_bytes * bucket_bytes
            cpu_budget = max(working, min(fit, round_up(needed + working, bucket_bytes)))
    gpu_budget = staging if device == "cuda" else 0
    return Placement(home, cpu_budget, gpu_budget, needed, working, pinnable, reason)


@dataclass
class TierVerdict:
    used: int
    capacity: int | None

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.used <= self.capacity

    @property
    def headroom(self) -> int | None:
        return None if self.capacity is None else self.capacity - self.used

    @property
    def utilization(self) -> float | None:
        if self.capacity is None:
            return None
        return self.used / self.capacity if self.capacity else float("inf") if self.used else 0.0

    def as_dict(self) -> dict:
        return {"used_bytes": self.used, "capacity_bytes": self.capacity, "fits": self.fits,
                "headroom_bytes": self.headroom,
                "utilization": None if self.utilization is None else round(self.utilization, 4)}


def binding(tiers: dict[str, TierVerdict]) -> str | None:
    """The tier closest to (or furthest past) its capacity."""
    known = {k: v.utilization for k, v in tiers.items() if v.utilization is not None and v.used}
    return max(known, key=known.get) if known else None


def candidate_world_sizes(gpus_per_node: int, limit: int = 65536) -> list[int]:
    """World sizes tried when searching the smallest that fits: powers of two up to one
    node, then whole nodes (1, 2, 3, 4, 6, 8, 12, 16, 24, ... of them)."""
    small = [1 << i for i in range(17) if (1 << i) < gpus_per_node]
    nodes = sorted({1 << i for i in range(17)} | {3 << i for i in range(16)})
    return sorted(set(small + [k * gpus_per_node for k in nodes if k * gpus_per_node <= limit]))
