"""Counters of what the store moved and how long its users waited.

Per tier, ``bytes_read[tier]`` counts bytes moved out of that tier toward a user (an NVMe
read, a pinned->GPU copy, a GPU->pinned copy) and ``bytes_written[tier]`` bytes moved into it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

TIERS = ("gpu", "cpu", "nvme")


def _per_tier() -> dict[str, int]:
    return {t: 0 for t in TIERS}


@dataclass
class StoreStats:
    """A snapshot of the store's counters since the last reset. Bytes, counts and seconds."""

    bytes_read: dict[str, int] = field(default_factory=_per_tier)
    bytes_written: dict[str, int] = field(default_factory=_per_tier)
    hits: int = 0          # acquires served by a resident or already in-flight (prefetched) bucket
    misses: int = 0        # acquires that had to start the read themselves
    evictions: int = 0     # buckets dropped from the pinned pool
    zero_fills: int = 0    # buckets first touched: filled with zeros, nothing read
    io_wait_s: float = 0.0  # seconds acquire()/flush() blocked on I/O or on pinned space
    elapsed_s: float = 0.0  # seconds since the last reset
    peak_pinned_bytes: int = 0
    peak_gpu_bytes: int = 0
    io: dict = field(default_factory=dict)  # I/O settings in force (TieredStore.io_settings)

    @property
    def nvme_bytes(self) -> int:
        return self.bytes_read["nvme"] + self.bytes_written["nvme"]

    @property
    def achieved_gbps(self) -> float:
        """NVMe bytes moved per second of wall time since the reset (GB/s, 1e9)."""
        return self.nvme_bytes / self.elapsed_s / 1e9 if self.elapsed_s > 0 else 0.0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    def as_dict(self) -> dict:
        return {
            "bytes_read": dict(self.bytes_read), "bytes_written": dict(self.bytes_written),
            "hits": self.hits, "misses": self.misses, "hit_rate": self.hit_rate,
            "evictions": self.evictions, "zero_fills": self.zero_fills,
            "io_wait_s": self.io_wait_s, "elapsed_s": self.elapsed_s,
            "achieved_gbps": self.achieved_gbps, "peak_pinned_bytes": self.peak_pinned_bytes,
            "peak_gpu_bytes": self.peak_gpu_bytes, "io": self.io,
        }


class StatsCounter:
    """Mutable counters behind ``TieredStore.stats()``; callers hold the store lock."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.current = StoreStats()
        self._t0 = time.monotonic()

    def snapshot(self, peak_pinned: int, peak_gpu: int) -> StoreStats:
        s = self.current
        return StoreStats(dict(s.bytes_read), dict(s.bytes_written), s.hits, s.misses,
                          s.evictions, s.zero_fills, s.io_wait_s, time.monotonic() - self._t0,
                          peak_pinned, peak_gpu)
