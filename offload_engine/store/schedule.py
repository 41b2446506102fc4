"""The access order that repeats every optimizer step, and distances along it.

The store uses it to read ``k`` buckets ahead of the cursor and to pick eviction victims by
next use (the bucket needed furthest in the future goes first: Belady's rule, exact here
because the order is known). With ``alternate`` the order is reversed every other step, so
the buckets still cached at the end of one step are the first ones used in the next.
"""

from __future__ import annotations

from typing import Hashable

INF = float("inf")


class Schedule:
    """A recorded per-step order of bucket keys (each key at most once per step)."""

    def __init__(self, order: list[Hashable], alternate: bool):
        if len(set(order)) != len(order):
            raise ValueError("a schedule lists each bucket at most once per step")
        self.order = list(order)
        self.alternate = alternate
        self.step = -1
        self._cur: list[Hashable] = []
        self._nxt: list[Hashable] = []
        self._pos_cur: dict[Hashable, int] = {}
        self._pos_nxt: dict[Hashable, int] = {}
        self.cursor = -1

    def order_for(self, step: int) -> list[Hashable]:
        """The order of step ``step`` (0-based)."""
        if self.alternate and step % 2 == 1:
            return self.order[::-1]
        return self.order

    def begin_step(self) -> list[Hashable]:
        """Advance to the next step; return its order."""
        self.step += 1
        self._cur = self.order_for(self.step)
        self._nxt = self.order_for(self.step + 1)
        self._pos_cur = {k: i for i, k in enumerate(self._cur)}
        self._pos_nxt = {k: i for i, k in enumerate(self._nxt)}
        self.cursor = -1
        return self._cur

    def mark_used(self, key: Hashable) -> None:
        """Move the cursor to ``key``'s position in this step (if it is in the schedule)."""
        pos = self._pos_cur.get(key)
        if pos is not None and pos > self.cursor:
            self.cursor = pos

    def next_use(self, key: Hashable) -> float:
        """Positions from the cursor to ``key``'s next use (this step or the next); inf if never."""
        pos = self._pos_cur.get(key)
        if pos is not None and pos > self.cursor:
            return pos - self.cursor
        pos = self._pos_nxt.get(key)
        if pos is None:
            return INF
        return len(self._cur) - self.cursor + pos

    def upcoming(self, k: int) -> list[Hashable]:
        """The next ``k`` keys after the cursor, running on into the next step's order."""
        out = self._cur[self.cursor + 1:self.cursor + 1 + k]
        if len(out) < k:
            out += self._nxt[:k - len(out)]
        return out
