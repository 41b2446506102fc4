"""First-fit allocation of page-aligned extents inside a fixed arena, coalesced on free.

Shared by the pinned host pool and the GPU arena: the arena is allocated once, and every
request is an (offset, size) inside it. Not thread-safe: callers hold their own lock.

Two ends, so that a budget sized as "k buckets streamed plus these bytes kept" is always
enough: short-lived, equal-size requests (streamed buckets, each given a whole bucket's
slot) are served first-fit from the bottom, where equal sizes cannot fragment; requests
kept for the arena's life (cpu-homed state, in odd sizes) are served from the top
(``take(..., top=True)``), out of the slots' way. Mixed first-fit of odd sizes could leave
the free bytes of a bucket in pieces no bucket fits (a store waited forever with half its
pool free).
"""

from __future__ import annotations

import bisect


class Extents:
    """Free-list bookkeeping for an arena of ``capacity`` bytes (offsets and sizes in bytes)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._offsets: list[int] = [0]  # sorted free extent starts
        self._sizes: list[int] = [capacity]
        self.in_use = 0
        self.peak_in_use = 0
        self.live = 0

    def take(self, size: int, top: bool = False) -> int | None:
        """Offset of a free extent of ``size`` bytes, or None when none is large enough:
        the lowest that fits, or with ``top`` the end of the highest that fits."""
        order = range(len(self._sizes) - 1, -1, -1) if top else range(len(self._sizes))
        for i in order:
            free = self._sizes[i]
            if free < size:
                continue
            start = self._offsets[i]
            offset = start + free - size if top else start
            if free == size:
                del self._offsets[i]
                del self._sizes[i]
            elif top:
                self._sizes[i] = free - size
            else:
                self._offsets[i] = start + size
                self._sizes[i] = free - size
            self.in_use += size
            self.live += 1
            self.peak_in_use = max(self.peak_in_use, self.in_use)
            return offset
        return None

    def give(self, offset: int, size: int) -> None:
        """Return ``[offset, offset+size)``, merging with adjacent free extents."""
        self.in_use -= size
        self.live -= 1
        i = bisect.bisect_left(self._offsets, offset)
        if i < len(self._offsets) and self._offsets[i] == offset + size:
            size += self._sizes[i]
            del self._offsets[i]
            del self._sizes[i]
        if i > 0 and self._offsets[i - 1] + self._sizes[i - 1] == offset:
            self._sizes[i - 1] += size
        else:
            self._offsets.insert(i, offset)
            self._sizes.insert(i, size)

    @property
    def largest_free(self) -> int:
        return max(self._sizes, default=0)
