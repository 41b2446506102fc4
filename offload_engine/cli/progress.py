"""A one-line progress display for long commands (consolidate, inspect --stats, diff)."""

from __future__ import annotations

import sys
import time


class ProgressLine:
    """A one-line progress display on a terminal, redrawn at most 5 times a second."""

    def __init__(self, stream=sys.stderr, label: str = "consolidate"):
        self.stream = stream
        self.label = label
        self.t0 = time.monotonic()
        self.last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self.last < 0.2:
            return
        self.last = now
        pct = 100.0 * done / total if total else 100.0
        rate = done / max(now - self.t0, 1e-9) / 1e6
        self.stream.write(f"\r{self.label}: {done / 1e9:.2f}/{total / 1e9:.2f} GB "
                          f"{pct:5.1f}% {rate:8.1f} MB/s")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()
