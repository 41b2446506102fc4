"""How much of the store's pinned pool ZeroMuon's state takes, and what it may keep there.

The pool holds the cpu-homed state whole, and for NVMe-homed state the buckets a step holds
at once (``working_buckets``, from the step schedule) plus one spare; what is left may keep
the NVMe arrays' short last buckets acquired for the optimizer's life (``kept_tails``).
ZeroMuon refuses a pool smaller than it needs and sizes its CUDA staging arena by the same
figure; the planner (``plan/placement.py``, ``plan/step_sim.py``) uses these functions as
they are. Pure: no torch.
"""

from __future__ import annotations

from typing import NamedTuple

from ..store.geometry import array_pool_bytes
from .step_schedule import store_calls


def peak_held(layout, reverse: bool) -> int:
    """Most buckets a step (every parameter with a gradient) holds acquired at the same
    time, walking forward or reversed."""
    refs: dict = {}
    peak = 0
    for kind, key in store_calls(layout, reverse):
        if kind == "acquire":
            refs[key] = refs.get(key, 0) + 1
            peak = max(peak, len(refs))
        else:
            refs[key] -= 1
            if not refs[key]:
                del refs[key]
    return peak


def working_buckets(layout) -> int:
    """Buckets of pinned pool a step needs beyond cpu-homed state when state is on NVMe:
    the most it holds at once (either walking direction) and one spare; e.g. a Muon bundle's
    momentum bucket while the masters of the bundles in flight are held, or one AdamW row
    (2-4 arrays), with the shared buckets kept between uses. ZeroMuon refuses a smaller
    pool and sizes its CUDA staging arena by it; the planner uses the same figure."""
    return layout.memo("working_buckets",
                       lambda: max(peak_held(layout, False), peak_held(layout, True)) + 1)


class PoolUse(NamedTuple):
    pinned: int   # bytes of the cpu-homed state in the pool (each bucket page-rounded)
    work: int     # the step's working set (``working_buckets``) when any state is on NVMe
    spare: int    # cpu_budget less both: the room ``kept_tails`` may use (< 0: too small)


def pool_use(layout, homes: dict[str, str], cpu_budget: int) -> PoolUse:
    """How ZeroMuon's pinned pool of ``cpu_budget`` bytes is taken with arrays homed by
    ``homes`` (name -> "cpu" | "nvme"): ZeroMuon refuses a negative ``spare`` and keeps its
    short tails in it; the planner's step replay does the same."""
    pinned = sum(array_pool_bytes(a.numel, a.dtype, layout.bucket_bytes)
                 for name, a in layout.arrays.items() if homes[name] == "cpu")
    nvme = any(homes[name] == "nvme" and a.numel for name, a in layout.arrays.items())
    work = working_buckets(layout) * layout.bucket_bytes if nvme else 0
    return PoolUse(pinned, work, cpu_budget - pinned - work)


def kept_tails(layout, homes: dict[str, str], spare: int) -> list[tuple[str, int]]:
    """The short last buckets ZeroMuon keeps acquired for its lifetime: those of NVMe-homed
    arrays, when ``spare`` (``pool_use(...).spare``: pool bytes beyond cpu-homed state and
    the working set) holds a bucket for each; else none.

    A short bucket takes a short extent of the pool. When two of them are the victims that
    make room for one full bucket, the store may, depending on when the first write-back
    lands, evict a third while it waits for the second; with them kept, every bucket the
    store evicts or reads is a full one and each fill evicts exactly one."""
    tails = [k for k in layout.short_tails() if homes.get(k[0]) == "nvme"]
    return tails if len(tails) * layout.bucket_bytes <= spare else []
