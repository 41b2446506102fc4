"""Adaptive I/O: step one direction's settings while running when the device changes.

``AdaptiveIO`` is fed samples (bytes moved, busy seconds: the time requests of that
direction were in flight) and answers with new settings or None. It is deterministic, so a
test drives it with synthetic samples:

- It measures in windows of at least ``window_bytes``. The first window on a setting sets
  its reference (and a faster window raises it).
- ``patience`` windows in a row below ``(1 - drop)`` x the reference start a trial: each
  other candidate gets one window, then the fastest of all (the current one's last window
  included) is kept and its window becomes the new reference.
- Candidates are the profile's bounds: the settings its probe measured (best first),
  never a field the user's config fixed.

Changing settings never changes bytes (io/file_io.py: every mode reads what every mode
wrote), only how fast they move.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .settings import DirectionSettings
from ..errors import InputError


@dataclass
class AdaptiveIO:
    """The controller of one direction. ``candidates[0]`` is in force at the start."""

    candidates: list[DirectionSettings]
    window_bytes: int = 1 << 30
    drop: float = 0.25
    patience: int = 2
    changes: list[tuple[DirectionSettings, DirectionSettings, str]] = field(default_factory=list)

    def __post_init__(self):
        if not self.candidates:
            raise InputError("AdaptiveIO needs at least one candidate setting")
        uniq = []
        for c in self.candidates:
            if not any(_same(c, u) for u in uniq):
                uniq.append(c)
        self.candidates = uniq
        self.current = self.candidates[0]
        self.reference: float | None = None  # bytes/s expected of the current setting
        self._slow = 0
        self._bytes = 0
        self._secs = 0.0
        self._trial: list[DirectionSettings] = []  # candidates still to try
        self._trial_rates: list[tuple[float, DirectionSettings]] = []

    def feed(self, nbytes: int, seconds: float) -> DirectionSettings | None:
        """Add a sample (bytes, seconds busy); the settings to switch to now, or None."""
        if nbytes <= 0 or seconds <= 0:
            return None
        self._bytes += nbytes
        self._secs += seconds
        if self._bytes < self.window_bytes:
            return None
        rate = self._bytes / self._secs
        self._bytes, self._secs = 0, 0.0
        return self._window(rate)

    def _window(self, rate: float) -> DirectionSettings | None:
        if self._trial_rates or self._trial:  # a trial is on: record, try the next
            self._trial_rates.append((rate, self.current))
            if self._trial:
                return self._switch(self._trial.pop(0), "trial")
            best_rate, best = max(self._trial_rates, key=lambda t: t[0])
            self._trial_rates = []
            self.reference = best_rate
            return self._switch(best, "fastest in trial") if best is not self.current else None
        if self.reference is None or rate > self.reference:
            self.reference = rate
            self._slow = 0
            return None
        if rate >= (1 - self.drop) * self.reference:
            self._slow = 0
            return None
        self._slow += 1
        if self._slow < self.patience or len(self.candidates) < 2:
            return None
        self._slow = 0
        self._trial_rates = [(rate, self.current)]
        self._trial = [c for c in self.candidates if c is not self.current]
        return self._switch(self._trial.pop(0), "trial")

    def _switch(self, to: DirectionSettings, why: str) -> DirectionSettings:
        self.changes.append((self.current, to, why))
        self.current = to
        return to


def _same(a: DirectionSettings, b: DirectionSettings) -> bool:
    return a.shape() == b.shape()


def candidates_from(profile: dict, op: str, chosen: DirectionSettings, fixed: set[str],
                    limit: int = 4) -> list[DirectionSettings]:
    """``chosen`` first, then up to ``limit - 1`` other points the profile's probe measured
    for ``op`` (fastest first), keeping the fields in ``fixed`` ("mode", "queue_depth",
    "block_bytes", "streams") as ``chosen`` has them; without measured points, ``chosen`` in the other
    mode (unless the mode is fixed)."""
    out = [chosen]
    points = sorted(profile.get("points") or [], key=lambda p: -p.get(f"{op}_gbps", 0))
    for p in points:
        c = DirectionSettings(p["mode"], int(p["queue_depth"]), int(p["block_bytes"]), "adaptive",
                              int(p.get("streams", 1)))
        c = c.with_(**{k: getattr(chosen, k) for k in fixed})
        if not any(_same(c, o) for o in out):
            out.append(c)
        if len(out) >= limit:
            break
    if not points and "mode" not in fixed:
        other = "buffered" if chosen.mode == "direct" else "direct"
        out.append(chosen.with_(mode=other, source="adaptive"))
    return out
