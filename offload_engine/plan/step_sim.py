"""Replay ZeroMuon's per-step acquire/release sequence against the store's residency rules.

Which NVMe buckets are still cached when a step begins decides the step's traffic. It is
not simply the tail of the previous step's order: ZeroMuon holds the master buckets of up
to three Muon chunks between its pipeline stages, and a bucket shared by two chunks from
its first use to its last, and a held bucket cannot be evicted, so buckets used while
others are held are pushed out instead. This module replays, without data, the store
calls ``optim/pipeline.py`` makes (``optim.step_events.step_events``: per Muon chunk,
acquire each row's momentum (+ master), release the momentum, hold the masters until the
chunk's apply stage; per AdamW chunk, acquire a row, release it, advance the pipeline one
stage) on a model of ``TieredStore``:

- a pool of ``cpu_budget`` bytes with the store's first-fit page-aligned extents
  (``io.extents.Extents``, the class the pool itself uses);
- prefetch of the next ``prefetch_depth`` scheduled buckets after every acquire and release,
  never evicting a bucket needed sooner than the one it fetches;
- eviction by next use in the schedule: ZeroMuon declares each step's order of first use
  (``Layout.step_order``), and the store takes the next step's to be its reverse (or the
  same order without ``alternate_order``); a dirty victim is written back first;
- a bucket never written is zero-filled, not read;
- the short last buckets of the NVMe arrays are acquired once, before the first step, and
  never let go when the pool has room for them (``optim.step_events.kept_tails``, ZeroMuon's
  own rule).

I/O is taken as instantaneous, so a write-back frees its buffer at once (the store waits for
it). ``tests/test_plan_calibration.py`` checks the result against the store's counters.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from ..io.align import ALIGN, round_up
from ..io.extents import Extents
from ..optim.step_events import kept_tails, pool_use, step_events


@dataclass
class SimResult:
    read: list[int]       # NVMe bytes read in each simulated step
    written: list[int]    # NVMe bytes written back in each step
    resident: list[int]   # NVMe bucket bytes cached when each step began


class _Bucket:
    __slots__ = ("key", "nbytes", "need", "home", "offset", "refs", "dirty", "on_disk", "used")

    def __init__(self, key, nbytes, home):
        self.key, self.nbytes, self.home = key, nbytes, home
        self.need = max(round_up(nbytes), ALIGN)
        self.offset = None
        self.refs = 0
        self.dirty = self.on_disk = self.used = False


def simulate(layout, arrays: dict, homes: dict[str, str], cpu_budget: int, prefetch_depth: int,
             steps: int = 5, alternate: bool = True) -> SimResult:
    """NVMe bytes read and written in each of ``steps`` optimizer steps (the first one
    zero-fills). ``arrays``: name -> ArrayPlan; ``homes``: name -> "cpu" | "nvme"."""
    orders = {rev: layout.step_order(rev) for rev in (False, True)}
    sizes = {name: a.buckets() for name, a in arrays.items()}
    buckets = {}
    for name, b in orders[False]:
        buckets[(name, b)] = _Bucket((name, b), sizes[name][b], homes.get(name, "nvme"))
    n = len(orders[False])
    pool = Extents(round_up(cpu_budget))
    homed = {n: homes.get(n, "nvme") for n in layout.arrays}
    for key in kept_tails(layout, homed, pool_use(layout, homed, cpu_budget).spare):
        b = buckets[key]       # ZeroMuon acquires these at construction and keeps them
        b.offset = pool.take(b.need)
        b.refs = 1
    events = {False: step_events(layout, False), True: step_events(layout, True)}
    res = SimResult([], [], [])
    # victims: used this step (by next-step position) beat unused ones (by this-step position)
    heap_used: list = []    # (-pos_next, key)
    heap_unused: list = []  # (-pos_cur, key)
    state = {"read": 0, "written": 0}

    for step in range(steps):
        reverse = alternate and step % 2 == 1
        cur = orders[reverse]
        nxt = cur[::-1] if alternate else cur
        pos_cur = {k: i for i, k in enumerate(cur)}
        pos_nxt = {k: i for i, k in enumerate(nxt)}
        for b in buckets.values():
            b.used = False
        heap_unused = [(-pos_cur[b.key], b.key) for b in buckets.values()
                       if b.offset is not None and b.refs == 0 and b.home == "nvme"]
        heapq.heapify(heap_unused)
        heap_used = []
        cursor = -1
        res.resident.append(sum(b.nbytes for b in buckets.values()
                                if b.offset is not None and b.home == "nvme"))
        state["read"] = state["written"] = 0

        def victim(limit_key=None):
            """Pop the unheld resident NVMe bucket with the furthest next use (None if
            nothing may go). ``limit_key``: a prefetch of that bucket, which only evicts
            buckets needed after it."""
            while heap_used:
                k = heap_used[0][1]
                v = buckets[k]
                if v.offset is None or v.refs or not v.used or -heap_used[0][0] != pos_nxt[k]:
                    heapq.heappop(heap_used)
                    continue
                if limit_key is not None:
                    lb = buckets[limit_key]
                    if lb.used and pos_nxt[k] <= pos_nxt[limit_key]:
                        return None
                heapq.heappop(heap_used)
                return v
            while heap_unused:
                k = heap_unused[0][1]
                v = buckets[k]
                if v.offset is None or v.refs or v.used:
                    heapq.heappop(heap_unused)
                    continue
                if limit_key is not None:
                    lb = buckets[limit_key]
                    if lb.used or pos_cur[k] <= pos_cur[limit_key]:
                        return None
                heapq.heappop(heap_unused)
                return v
            return None

        def evict(v):
            if v.dirty:
                state["written"] += v.nbytes
                v.dirty = False
                v.on_disk = True
            pool.give(v.offset, v.need)
            v.offset = None

        def fill(b, demand: bool) -> bool:
            while True:
                off = pool.take(b.need)
                if off is not None:
                    b.offset = off
                    if b.home == "nvme" and b.on_disk:
                        state["read"] += b.nbytes
                    return True
                v = victim(None if demand else b.key)
                if v is None:
                    if demand:
                        raise RuntimeError(f"pool of {cpu_budget} bytes cannot hold the buckets "
                                           "ZeroMuon holds at once")
                    return False
                evict(v)

        def pump():
            for k in (cur[cursor + 1:cursor + 1 + prefetch_depth]
                      + nxt[:max(0, prefetch_depth - (n - cursor - 1))]):
                b = buckets[k]
                if b.offset is not None:
                    continue
                if not fill(b, demand=False):
                    break
                if b.home == "nvme" and b.refs == 0:
                    _push_candidate(b)

        def _push_candidate(b):
            if b.used:
                heapq.heappush(heap_used, (-pos_nxt[b.key], b.key))
            else:
                heapq.heappush(heap_unused, (-pos_cur[b.key], b.key))

        pump()  # begin_step
        for kind, key in events[reverse]:
            b = buckets[key]
            if kind == "acquire":
                if pos_cur[key] > cursor:
                    cursor = pos_cur[key]
                b.used = True
                b.refs += 1
                if b.offset is None:
                    fill(b, demand=True)
                pump()
            else:
                b.refs -= 1
                if b.home == "nvme":
                    b.dirty = True
                if b.refs == 0 and b.home == "nvme" and b.offset is not None:
                    _push_candidate(b)
                pump()
        res.read.append(state["read"])
        res.written.append(state["written"])
    return res


def steady_state(layout, arrays, homes, cpu_budget, prefetch_depth, alternate: bool = True):
    """(read, written, resident) of a forward-order and a reversed-order step, once the
    pattern repeats (steps 3 and 4 of a replay; step 0 only zero-fills)."""
    r = simulate(layout, arrays, homes, cpu_budget, prefetch_depth, steps=5, alternate=alternate)
    fwd, rev = 4, 3
    return ((r.read[fwd], r.read[rev]), (r.written[fwd], r.written[rev]),
            (r.resident[fwd], r.resident[rev]))
