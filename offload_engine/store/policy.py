"""The store's residency rules: which buckets to read ahead and which one to evict.

Pure bookkeeping over bucket keys (any hashable, e.g. ``(array, bucket_index)``): no torch,
no threads, no I/O, no pool. ``TieredStore`` drives it (it owns the buckets' states, the
pinned pool and the I/O) and so does the planner's step replay (``plan/step_sim.py``, over a
model of the pool), so the planner's traffic figures come from these very rules.

The rules (docs/store.md, "How buckets move"):

- **Schedule.** The optimizer uses the buckets in the same order every step: ``forward`` on
  even steps and, with ``alternate``, ``backward`` on odd ones (so the buckets still cached
  at the end of one step are the first ones the next step uses). A cursor marks the
  furthest position used in the current step.
- **Prefetch** reads the next ``prefetch_depth`` buckets after the cursor, running on into
  the next step's order.
- **Eviction** (Belady): the unheld resident bucket whose next use is furthest in the
  future goes. Exact here, since the order is known. Ties (only buckets never used again
  can tie) go to a clean bucket before a dirty one, then to the least recently used: a
  clean victim frees its buffer at once and costs no write, and among equals the one idle
  longest is the least likely to be wanted by a caller outside the schedule.
- A **prefetch** never evicts a bucket needed sooner than (or as soon as) the one it
  fetches; a prefetch of a bucket outside the schedule only evicts clean buckets that are
  never used again.
- A **demand** fill (a caller waits for the bucket) may evict any candidate, except that
  while write-backs are in flight it does not evict one needed within the prefetch window:
  that bucket was read for imminent use, and the write-backs will free room shortly.
- **Credit**: bytes that write-backs in flight will free (their buckets are evicted when
  the write lands) are handed out once per prefetch pass; a fill they cover waits for them
  instead of evicting one more bucket.

Next-use times are absolute: a use at position ``p`` of step ``s`` is at time ``s*n + p``
(``n`` buckets per step). A bucket's time only changes when the cursor passes it (it was
used, or skipped) or when a step begins with it unused, so the eviction candidates sit in a
heap keyed by time and re-keyed only then: choosing a victim is O(log n), not a scan of
everything resident.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Hashable, Iterable
from ..errors import InputError

INF = float("inf")
Key = Hashable


class StepSchedule:
    """The per-step bucket orders, the current step and its cursor.

    Args:
        forward: the order of first use in a forward step (each key once).
        backward: the same keys in the order of first use of a backward step; default the
            reverse of ``forward``. Not always simply the reverse: a bucket two parts of a
            step share is first used where the walk meets it first.
        alternate: forward on even steps, backward on odd ones; else forward every step.
        step: the step already under way (-1: none; the first ``begin_step`` is step 0).
    """

    def __init__(self, forward: Iterable[Key], backward: Iterable[Key] | None = None,
                 alternate: bool = True, step: int = -1):
        self.forward = list(forward)
        self.backward = self.forward[::-1] if backward is None else list(backward)
        for name, order in (("forward", self.forward), ("backward", self.backward)):
            if len(set(order)) != len(order):
                raise InputError(f"the {name} order lists a bucket more than once")
        if set(self.forward) != set(self.backward):
            raise InputError("the forward and backward orders must list the same buckets")
        self.alternate = alternate
        self.step = step
        self.cursor = -1          # furthest position used in this step (-1: none yet)
        self._cur: list[Key] = []
        self._nxt: list[Key] = []
        self._pos_cur: dict[Key, int] = {}
        self._pos_nxt: dict[Key, int] = {}

    @property
    def length(self) -> int:
        """Buckets per step."""
        return len(self.forward)

    def is_backward(self, step: int) -> bool:
        """Whether step ``step`` (0-based) walks the backward order."""
        return self.alternate and step % 2 == 1

    def order_for(self, step: int) -> list[Key]:
        """The order of step ``step`` (0-based)."""
        return self.backward if self.is_backward(step) else self.forward

    def begin_step(self) -> list[Key]:
        """Advance to the next step; return its order."""
        self.step += 1
        self._cur = self.order_for(self.step)
        self._nxt = self.order_for(self.step + 1)
        self._pos_cur = {k: i for i, k in enumerate(self._cur)}
        self._pos_nxt = self._pos_cur if self._nxt is self._cur else {
            k: i for i, k in enumerate(self._nxt)}
        self.cursor = -1
        return self._cur

    def unpassed(self) -> list[Key]:
        """Keys of this step's order the cursor has not reached."""
        return self._cur[self.cursor + 1:]

    def mark_used(self, key: Key) -> list[Key]:
        """Move the cursor to ``key``'s position in this step, if it is ahead; returns the
        keys passed (``key`` and any skipped): their next use is now in the next step."""
        pos = self._pos_cur.get(key)
        if pos is None or pos <= self.cursor:
            return []
        passed = self._cur[self.cursor + 1:pos + 1]
        self.cursor = pos
        return passed

    @property
    def now(self) -> int:
        """The time of the cursor (see ``next_use_at``)."""
        return self.step * self.length + self.cursor

    def next_use_at(self, key: Key) -> float:
        """Time of ``key``'s next use: ``step * length + position``, in this step if the
        cursor has not passed it, else in the next; INF if it has none (not scheduled, or
        no step begun)."""
        pos = self._pos_cur.get(key)
        if pos is not None and pos > self.cursor:
            return self.step * self.length + pos
        pos = self._pos_nxt.get(key)
        if pos is None:
            return INF
        return (self.step + 1) * self.length + pos

    def next_use(self, key: Key) -> float:
        """Positions from the cursor to ``key``'s next use; INF if never."""
        return self.next_use_at(key) - self.now

    def upcoming(self, k: int) -> list[Key]:
        """The next ``k`` keys after the cursor, running on into the next step's order."""
        out = self._cur[self.cursor + 1:self.cursor + 1 + k]
        if len(out) < k:
            out += self._nxt[:k - len(out)]
        return out


class Credit:
    """Bytes that write-backs in flight will free and that no fill of this prefetch pass
    has claimed yet."""

    def __init__(self, nbytes: int):
        self.left = nbytes

    def claim(self, nbytes: int) -> bool:
        """Claim ``nbytes`` for one fill: True (the fill waits for the write-backs instead of
        evicting) when the credit left covers them."""
        if self.left >= nbytes:
            self.left -= nbytes
            return True
        return False


class WriteBacks:
    """Write-backs in flight, and the pool bytes that those ending in an eviction will free."""

    def __init__(self):
        self.in_flight = 0
        self.freeing = 0                       # bytes
        self._evicting: dict[Key, int] = {}    # key -> pool bytes freed when its write lands

    def start(self, key: Key, pool_bytes: int, evict_after: bool) -> None:
        """A write-back of ``key`` started; ``evict_after``: its ``pool_bytes`` go back to the
        pool when it lands."""
        self.in_flight += 1
        if evict_after:
            self._evicting[key] = pool_bytes
            self.freeing += pool_bytes

    def keep(self, key: Key) -> None:
        """``key`` is wanted again before its write landed: it stays resident after all."""
        self.freeing -= self._evicting.pop(key, 0)

    def finish(self, key: Key) -> bool:
        """The write-back of ``key`` ended (landed or failed); returns whether it was to evict."""
        self.in_flight -= 1
        nbytes = self._evicting.pop(key, None)
        if nbytes is None:
            return False
        self.freeing -= nbytes
        return True

    def evicting(self, key: Key) -> bool:
        """Whether ``key``'s write-back in flight ends in its eviction."""
        return key in self._evicting

    def credit(self) -> Credit:
        """The credit for one prefetch pass: the bytes the write-backs will free."""
        return Credit(self.freeing)


class _Candidates:
    """Eviction candidates in a heap by rank ``(-next use time, dirty, last use)``: the
    smallest goes first. Entries are never removed from the middle: a key's current rank is
    in ``rank``, and heap entries that disagree with it are dropped when they surface."""

    def __init__(self):
        self.rank: dict[Key, tuple] = {}
        self._heap: list = []
        self._seq = itertools.count()  # equal ranks come out in the order they went in

    def put(self, key: Key, rank: tuple) -> None:
        if self.rank.get(key) == rank:
            return
        self.rank[key] = rank
        heapq.heappush(self._heap, (rank, next(self._seq), key))
        if len(self._heap) > 2 * len(self.rank) + 64:
            self._compact()

    def discard(self, key: Key) -> None:
        self.rank.pop(key, None)

    def top(self) -> tuple[Key, tuple] | None:
        heap = self._heap
        while heap:
            rank, _, key = heap[0]
            if self.rank.get(key) == rank:
                return key, rank
            heapq.heappop(heap)
        return None

    def _compact(self) -> None:
        """Drop stale entries (a heap re-keyed often between evictions would only grow)."""
        self._heap = [(r, next(self._seq), k) for k, r in self.rank.items()]
        heapq.heapify(self._heap)


class ResidencyPolicy:
    """The residency rules over bucket keys (see the module docstring).

    The caller owns the buckets and reports what happens to them: ``note_use`` when a
    bucket is acquired, ``offer`` when it becomes an eviction candidate (resident, unheld,
    evictable, its bytes valid) or its dirtiness changes, ``withdraw`` when it stops being
    one, and ``writebacks`` when write-backs start and land. It asks ``upcoming`` what to
    read ahead and ``choose_victim`` what to evict.

    Without a declared schedule the first step's order of first use is recorded
    (``begin_step`` returns None while it is) and becomes the forward order; the backward
    order is then its reverse.
    """

    def __init__(self, prefetch_depth: int, alternate: bool):
        self.prefetch_depth = prefetch_depth
        self.alternate = alternate
        self.schedule: StepSchedule | None = None
        self.writebacks = WriteBacks()
        self._candidates = _Candidates()
        self._recording: list[Key] | None = None
        self._recorded: set[Key] = set()

    # -- the schedule ----------------------------------------------------------------------
    def declare(self, forward: Iterable[Key], backward: Iterable[Key] | None = None) -> None:
        """Declare the per-step orders (see ``StepSchedule``); steps count from the next
        ``begin_step``. Ends a recording."""
        self.schedule = StepSchedule(forward, backward, self.alternate)
        self._recording = None
        self._rekey(list(self._candidates.rank))

    def clear(self) -> None:
        """Forget the schedule: every bucket's next use is unknown (INF)."""
        self.schedule = None
        self._rekey(list(self._candidates.rank))

    def begin_step(self) -> list[Key] | None:
        """A step begins: returns its order, or None while the first step is recorded."""
        sched = self.schedule
        if sched is None:
            if not self._recording:
                self._recording, self._recorded = [], set()
                return None
            # the recorded step was step 0 of this order: the next one walks it backward
            sched = self.schedule = StepSchedule(self._recording, None, self.alternate, step=0)
            self._recording = None
            changed = list(self._candidates.rank)
        elif sched.step < 0:
            changed = list(self._candidates.rank)   # every time was INF
        else:
            changed = sched.unpassed()              # their next use moves to the new step
        order = sched.begin_step()
        self._rekey(changed)
        return order

    @property
    def step_is_backward(self) -> bool:
        """Whether the step under way walks the backward order (False with no schedule)."""
        sched = self.schedule
        return sched is not None and sched.step >= 0 and sched.is_backward(sched.step)

    def note_use(self, key: Key) -> None:
        """``key`` is being used (acquired) now."""
        sched = self.schedule
        if sched is not None:
            passed = sched.mark_used(key)
            if passed:
                self._rekey(passed)
        elif self._recording is not None and key not in self._recorded:
            self._recording.append(key)
            self._recorded.add(key)

    def next_use_at(self, key: Key) -> float:
        """Time of ``key``'s next use (``StepSchedule.next_use_at``); INF without a schedule."""
        return self.schedule.next_use_at(key) if self.schedule is not None else INF

    def upcoming(self) -> list[Key]:
        """The buckets to read ahead: the next ``prefetch_depth`` of the schedule."""
        if self.schedule is None or not self.prefetch_depth:
            return []
        return self.schedule.upcoming(self.prefetch_depth)

    # -- eviction ------------------------------------------------------------------------------
    def offer(self, key: Key, dirty: bool, last_use: int) -> None:
        """``key`` is (still) an eviction candidate; ``dirty``: evicting it costs a write;
        ``last_use``: when it was last acquired (any increasing counter)."""
        self._candidates.put(key, (-self.next_use_at(key), dirty, last_use))

    def withdraw(self, key: Key) -> None:
        """``key`` is no longer a candidate (held, evicted, in flight, or not evictable)."""
        self._candidates.discard(key)

    def is_candidate(self, key: Key) -> bool:
        return key in self._candidates.rank

    def choose_victim(self, demand: bool, fetch: Key | None = None) -> Key | None:
        """The candidate to evict to make room for a fill, withdrawn; None if none may go.

        ``demand``: a caller waits for the bucket being filled. Otherwise it is a prefetch
        of ``fetch``, which never evicts a bucket needed sooner.
        """
        top = self._candidates.top()
        if top is None:
            return None
        key, (neg_time, dirty, _) = top
        when = -neg_time
        if demand:
            if (self.writebacks.in_flight and when != INF
                    and when - self.schedule.now <= self.prefetch_depth):
                return None  # read for imminent use: wait for the write-backs instead
        else:
            limit = self.next_use_at(fetch)
            if limit == INF:
                if when != INF or dirty:
                    return None
            elif when <= limit:
                return None
        self._candidates.discard(key)
        return key

    def _rekey(self, keys: Iterable[Key]) -> None:
        """Give candidates among ``keys`` their current next-use time."""
        ranks = self._candidates.rank
        for key in keys:
            rank = ranks.get(key)
            if rank is not None:
                self._candidates.put(key, (-self.next_use_at(key), rank[1], rank[2]))


__all__ = ["INF", "Credit", "ResidencyPolicy", "StepSchedule", "WriteBacks"]
