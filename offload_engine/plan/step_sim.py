"""Replay ZeroMuon's per-step acquire/release sequence against the store's own residency policy.

Which NVMe buckets are still cached when a step begins decides the step's traffic. It is
not simply the tail of the previous step's order: ZeroMuon holds the master buckets of up
to three Muon bundles between its pipeline stages, and a bucket shared by two bundles from
its first use to its last, and a held bucket cannot be evicted, so buckets used while
others are held are pushed out instead. This module replays, without data, the store
calls of the step schedule ZeroMuon's step runs (``optim.step_schedule.store_calls``: per
Muon bundle, acquire each row's momentum (+ master), release the momentum, hold the
masters until the bundle's apply stage; per AdamW bundle, acquire a row, release it,
advance the pipeline one stage) on a model of ``TieredStore``:

- a pool of ``cpu_budget`` bytes with the store's first-fit page-aligned extents
  (``io.extents.Extents``, the class the pool itself uses);
- the store's policy itself (``store.policy.ResidencyPolicy``, the object TieredStore
  drives): the schedule ZeroMuon declares (``Layout.step_order`` of each walking direction,
  alternating with ``alternate_order``), prefetch of the next ``prefetch_depth`` scheduled
  buckets after every acquire and release, never evicting a bucket needed sooner than the
  one it fetches, and eviction by next use; a dirty victim is written back first;
- a bucket never written is zero-filled, not read;
- the short last buckets of the NVMe arrays are acquired once, before the first step, and
  never let go when the pool has room for them (``optim.pool_budget.kept_tails``, ZeroMuon's
  own rule).

I/O is taken as instantaneous, so a write-back frees its buffer at once (the store waits for
it): no write-back is ever in flight here, and the policy's rules about them (credit, demand
fills that wait for write-backs) never apply. ``tests/plan/test_plan_calibration.py`` checks the
result against the store's counters.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..io.align import round_up
from ..io.extents import Extents
from ..optim.pool_budget import kept_tails, pool_use
from ..optim.step_schedule import store_calls
from ..store.geometry import bucket_sizes, pool_bytes
from ..store.policy import ResidencyPolicy
from ..errors import InputError


@dataclass
class SimResult:
    read: list[int]       # NVMe bytes read in each simulated step
    written: list[int]    # NVMe bytes written back in each step
    resident: list[int]   # NVMe bucket bytes cached when each step began


class _Bucket:
    """What the replay tracks of one bucket: the store's Bucket without bytes."""

    __slots__ = ("key", "nbytes", "need", "home", "offset", "refs", "dirty", "on_disk",
                 "last_use")

    def __init__(self, key, nbytes: int, home: str, slot: int):
        self.key, self.nbytes, self.home = key, nbytes, home
        # what the pinned pool carves out for it: a streamed bucket a whole slot
        # (TieredStore._take_buffer), a cpu-homed one its own size, from the top
        self.need = max(pool_bytes(nbytes), slot) if home == "nvme" else pool_bytes(nbytes)
        self.offset = None               # extent in the model pool while resident
        self.refs = 0
        self.dirty = self.on_disk = False
        self.last_use = 0


class _Replay:
    """A model of TieredStore: the same policy object over a pool of extents, no bytes."""

    def __init__(self, policy: ResidencyPolicy, buckets: dict, pool: Extents, cpu_budget: int):
        self.policy, self.buckets, self.pool = policy, buckets, pool
        self.cpu_budget = cpu_budget
        self.read = self.written = 0
        self.tick = 0

    def update_candidate(self, b: _Bucket) -> None:
        """As TieredStore: an unheld resident NVMe bucket may be evicted."""
        if b.offset is not None and not b.refs and b.home == "nvme":
            self.policy.offer(b.key, b.dirty, b.last_use)
        else:
            self.policy.withdraw(b.key)

    def evict(self, b: _Bucket) -> None:
        if b.dirty:            # written back, instantly
            self.written += b.nbytes
            b.dirty = False
            b.on_disk = True
        self.pool.give(b.offset, b.need)
        b.offset = None
        self.policy.withdraw(b.key)

    def fill(self, b: _Bucket, demand: bool) -> bool:
        """Bring ``b`` into the pool, evicting the policy's victims; False when a prefetch
        may not evict anything (a demand fill that cannot is a pool too small)."""
        while True:
            off = self.pool.take(b.need, top=b.home != "nvme")
            if off is not None:
                b.offset = off
                if b.home == "nvme" and b.on_disk:
                    self.read += b.nbytes   # else zero-filled: nothing read
                self.update_candidate(b)
                return True
            key = self.policy.choose_victim(demand, b.key)
            if key is None:
                if demand:
                    raise InputError(f"pool of {self.cpu_budget} bytes cannot hold the "
                                       "buckets ZeroMuon holds at once")
                return False
            self.evict(self.buckets[key])

    def pump(self) -> None:
        """Read ahead the policy's upcoming buckets (a bucket once, even where the window runs
        into the next step)."""
        for key in dict.fromkeys(self.policy.upcoming()):
            b = self.buckets[key]
            if b.offset is not None:
                continue
            if not self.fill(b, demand=False):
                break

    def acquire(self, key) -> None:
        b = self.buckets[key]
        self.policy.note_use(key)
        b.refs += 1
        self.update_candidate(b)
        if b.offset is None:
            self.fill(b, demand=True)
        self.tick += 1
        b.last_use = self.tick
        self.pump()

    def release(self, key) -> None:
        b = self.buckets[key]
        b.refs -= 1
        if b.home == "nvme":
            b.dirty = True
        self.update_candidate(b)
        self.pump()


def simulate(layout, arrays: dict, homes: dict[str, str], cpu_budget: int, prefetch_depth: int,
             steps: int = 5, alternate: bool = True) -> SimResult:
    """NVMe bytes read and written in each of ``steps`` optimizer steps (the first one
    zero-fills). ``arrays``: name -> ArrayPlan; ``homes``: name -> "cpu" | "nvme";
    ``cpu_budget``: bytes of the pinned pool."""
    forward, backward = layout.step_order(False), layout.step_order(True)
    sizes = {name: bucket_sizes(a.numel, a.itemsize, a.bucket_bytes) for name, a in arrays.items()}
    slot = min(pool_bytes(layout.bucket_bytes), round_up(cpu_budget))
    buckets = {key: _Bucket(key, sizes[key[0]][key[1]], homes.get(key[0], "nvme"), slot)
               for key in forward}
    policy = ResidencyPolicy(prefetch_depth, alternate)
    sim = _Replay(policy, buckets, Extents(round_up(cpu_budget)), cpu_budget)
    homed = {n: homes.get(n, "nvme") for n in layout.arrays}
    for key in kept_tails(layout, homed, pool_use(layout, homed, cpu_budget).spare):
        sim.acquire(key)       # ZeroMuon keeps these acquired from its construction on
    policy.declare(forward, backward)  # as ZeroMuon does, once
    events = {False: store_calls(layout, False), True: store_calls(layout, True)}
    res = SimResult([], [], [])
    for _ in range(steps):
        res.resident.append(sum(b.nbytes for b in buckets.values()
                                if b.offset is not None and b.home == "nvme"))
        sim.read = sim.written = 0
        policy.begin_step()
        sim.pump()
        for kind, key in events[policy.step_is_backward]:
            if kind == "acquire":
                sim.acquire(key)
            else:
                sim.release(key)
        res.read.append(sim.read)
        res.written.append(sim.written)
    return res


def steady_state(layout, arrays, homes, cpu_budget, prefetch_depth, alternate: bool = True):
    """(read, written, resident) of a forward-order and a reversed-order step, once the
    pattern repeats (steps 3 and 4 of a replay; step 0 only zero-fills)."""
    r = simulate(layout, arrays, homes, cpu_budget, prefetch_depth, steps=5, alternate=alternate)
    fwd, rev = 4, 3
    return ((r.read[fwd], r.read[rev]), (r.written[fwd], r.written[rev]),
            (r.resident[fwd], r.resident[rev]))
