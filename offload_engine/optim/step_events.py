"""The store calls one ZeroMuon step makes, without the math: what the pipeline does, what
the planner replays, and how many buckets a step holds at once.

A step walks the bundles (reversed on alternate steps) and acquires each row's buckets:

- Muon bundle: per row, acquire the momentum (and master) bucket, release the momentum;
  the masters stay held until the bundle's apply stage, two Muon bundles later or after
  AdamW bundles advance the pipeline (``MuonPipeline``: ``SLOTS`` bundles in flight);
- AdamW bundle: per row, acquire every array's bucket, release them all; then advance the
  Muon pipeline one stage.

A bucket several rows use (the state layout packs bundles back to back, so a bundle's first
and last buckets may be its neighbours' too) is released to the store only when its last
user of the step is done (``Leases``): between two uses it stays acquired, so the store
neither evicts nor re-reads it and the step reads and writes it once.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from ..store.geometry import array_pool_bytes
from .state_layout import StateKind

SLOTS = 3


class Leases:
    """Release bookkeeping for one step: a bucket used by several rows goes back to the
    store when all of them are done with it.

    ``done(key, item)`` is called once per row that uses ``key`` (``item`` None for a row
    that skipped it) and returns the items to release now: nothing while other rows of
    the step still need the bucket, else every item held back so far plus this one.
    """

    def __init__(self, uses: dict):
        self.left = {k: n for k, n in uses.items() if n > 1}
        self.held: dict = {}

    def done(self, key, item) -> list:
        n = self.left.get(key)
        if n is None:
            return [] if item is None else [item]
        held = self.held.setdefault(key, [])
        if item is not None:
            held.append(item)
        if n > 1:
            self.left[key] = n - 1
            return []
        del self.left[key]
        return self.held.pop(key)

    def pending(self) -> int:
        """Items held back (0 at the end of a complete step)."""
        return sum(len(v) for v in self.held.values())


def step_events(layout, reverse: bool) -> list[tuple[str, tuple[str, int]]]:
    """("acquire" | "release", (array, bucket)) in the order a step in which every parameter
    has a gradient issues them to the store."""
    ev: list = []
    leases = Leases(layout.uses())
    rows = {}
    for c, row, names in layout.walk(reverse):
        rows.setdefault(c.index, []).append((row, names))
    to_orth: deque = deque()
    to_apply: deque = deque()

    def release(name, row):
        for key in leases.done((name, row.buckets[name]), (name, row.buckets[name])):
            ev.append(("release", key))

    def apply_oldest():
        bundle = to_apply.popleft()
        master = bundle.key(StateKind.MASTER)
        if master is not None:
            for row, _ in rows.get(bundle.index, []):
                release(master.name, row)

    def orth_oldest():
        to_apply.append(to_orth.popleft())

    def advance():
        if to_apply:
            apply_oldest()
        elif to_orth:
            orth_oldest()

    for bundle in (layout.bundles[::-1] if reverse else layout.bundles):
        if bundle.kind == "muon":
            mom = bundle.key(StateKind.MOMENTUM).name
            for row, names in rows.get(bundle.index, []):
                for n in names:
                    ev.append(("acquire", (n, row.buckets[n])))
                release(mom, row)
            to_orth.append(bundle)
            while len(to_orth) > 1:
                orth_oldest()
            while len(to_apply) > 1:
                apply_oldest()
        else:
            for row, names in rows.get(bundle.index, []):
                for n in names:
                    ev.append(("acquire", (n, row.buckets[n])))
                for n in names:
                    release(n, row)
            advance()
    while to_orth:
        orth_oldest()
    while to_apply:
        apply_oldest()
    assert leases.pending() == 0
    return ev


def peak_held(layout, reverse: bool) -> int:
    """Most buckets a step holds acquired at the same time."""
    refs: dict = {}
    peak = 0
    for kind, key in step_events(layout, reverse):
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
    if "working" not in layout._cache:
        layout._cache["working"] = max(peak_held(layout, False), peak_held(layout, True)) + 1
    return layout._cache["working"]


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
