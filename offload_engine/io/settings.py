"""How one direction (reads or writes) moves bytes: mode, pieces in flight, piece size, streams.

``mode`` is "direct" (O_DIRECT where the file system takes it and the piece is aligned; the
page cache otherwise) or "buffered" (always through the page cache, with readahead hints on
reads and write-out plus DONTNEED after writes, so the cache does not grow with the state).
``streams`` is how many requests are served at once, one piece from each in turn: a disk
that reads several regions at once faster than one region at a greater depth (this VM's
virtual disk: 8 GiB of chunk files read 1.0-1.3 GB/s one chunk at a time, 1.4-1.6 with 8
chunk files at once, same pieces in flight) gets them all busy; 1 serves requests in order.
``source`` says where the choice came from: "config" (the user's), "profile" (the device
profile, io/device_profile.py), "adaptive" (stepped while running, io/adaptive.py) or
"default" (built in).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..units import MiB
from ..errors import InputError

MODES = ("direct", "buffered")
DIRECTIONS = ("read", "write")
FIELDS = ("mode", "queue_depth", "block_bytes", "streams")  # what moves the bytes


@dataclass(frozen=True)
class DirectionSettings:
    """Mode, queue depth (pieces in flight), block size (bytes per piece) and streams
    (requests served at once) of one direction."""

    mode: str = "direct"
    queue_depth: int = 8
    block_bytes: int = 8 * MiB
    source: str = "default"
    streams: int = 1

    def __post_init__(self):
        if self.mode not in MODES:
            raise InputError(f"I/O mode must be one of {MODES}, got {self.mode!r}")
        if self.queue_depth < 1:
            raise InputError(f"queue_depth must be >= 1, got {self.queue_depth}")
        if self.streams < 1:
            raise InputError(f"streams must be >= 1, got {self.streams}")
        if self.block_bytes <= 0 or self.block_bytes % 4096:
            raise InputError(f"block size must be a positive multiple of 4096 bytes, got "
                             f"{self.block_bytes}")

    def with_(self, **changes) -> "DirectionSettings":
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)

    def shape(self) -> tuple:
        """What moves the bytes (``FIELDS``), without where the choice came from."""
        return tuple(getattr(self, f) for f in FIELDS)

    def describe(self) -> str:
        """e.g. "direct QD 8 x 8 MiB, 4 streams"."""
        size = (f"{self.block_bytes >> 20} MiB" if self.block_bytes % MiB == 0
                else f"{self.block_bytes >> 10} KiB")
        streams = f", {self.streams} streams" if self.streams > 1 else ""
        return f"{self.mode} QD {self.queue_depth} x {size}{streams}"


# The built-in choice when there is no profile and no config: what the store used before
# profiles existed (O_DIRECT where accepted, 8 pieces of 8 MiB in flight).
DEFAULT = DirectionSettings()
