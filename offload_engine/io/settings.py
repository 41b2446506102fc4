"""How one direction (reads or writes) moves bytes: mode, requests in flight, piece size.

``mode`` is "direct" (O_DIRECT where the file system takes it and the piece is aligned; the
page cache otherwise) or "buffered" (always through the page cache, with readahead hints on
reads and write-out plus DONTNEED after writes, so the cache does not grow with the state).
``source`` says where the choice came from: "config" (the user's), "profile" (the device
profile, io/device_profile.py), "adaptive" (stepped while running, io/adaptive.py) or
"default" (built in).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..units import MiB

MODES = ("direct", "buffered")
DIRECTIONS = ("read", "write")


@dataclass(frozen=True)
class DirectionSettings:
    """Mode, queue depth (pieces in flight) and block size (bytes per piece) of one direction."""

    mode: str = "direct"
    queue_depth: int = 8
    block_bytes: int = 8 * MiB
    source: str = "default"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"I/O mode must be one of {MODES}, got {self.mode!r}")
        if self.queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {self.queue_depth}")
        if self.block_bytes <= 0 or self.block_bytes % 4096:
            raise ValueError(f"block size must be a positive multiple of 4096 bytes, got "
                             f"{self.block_bytes}")

    def with_(self, **changes) -> "DirectionSettings":
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)


# The built-in choice when there is no profile and no config: what the store used before
# profiles existed (O_DIRECT where accepted, 8 pieces of 8 MiB in flight).
DEFAULT = DirectionSettings()
