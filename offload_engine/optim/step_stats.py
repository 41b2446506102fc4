"""What one optimizer step moved and how long its parts took (``ZeroMuon.last_step_stats``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class StepStats:
    """Counters of one ``step()``. Bytes, counts and seconds; per rank.

    all_to_all bytes exclude the block a rank sends to itself (copied locally). Store
    counters cover the time since the previous step ended (write-behind of the previous
    step's buckets that lands during forward/backward counts here), per tier.
    """

    step: int = 0
    a2a_bytes_sent: int = 0
    a2a_bytes_received: int = 0
    a2a_calls: int = 0
    ns_calls: int = 0                 # Newton-Schulz runs on this rank (one per owned matrix)
    muon_params: int = 0              # Muon parameters updated (those with a gradient)
    adamw_params: int = 0
    store_bytes_read: dict = field(default_factory=dict)
    store_bytes_written: dict = field(default_factory=dict)
    store_hits: int = 0
    store_misses: int = 0
    store_io_wait_s: float = 0.0
    step_s: float = 0.0
    comm_wait_s: float = 0.0          # blocked in Work.wait()
    ns_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)
