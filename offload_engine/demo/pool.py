"""The demo's pinned pool: sized below each rank's optimizer state, so the state streams.

The demo's point is state homed on NVMe moving through a small pool. The larger presets
stream through 16 MiB of 2 MiB buckets; the tiny ones (tiny: about 53 KiB of state per
rank of two, moe: about 430 KiB) would fit whole in that pool and move 0 bytes, so their
pool is four buckets of 1/16 of the state (at least 4 KiB each): one step reads and writes
most of the state.
"""

from __future__ import annotations

from typing import NamedTuple

LARGE_POOL = 16 << 20      # bytes: the pool of the presets whose state exceeds it
LARGE_BUCKET = 2 << 20     # bytes
MIN_BUCKET = 4 << 10       # bytes: one page
POOL_BUCKETS = 4           # buckets in a small pool: the step's working set of a tiny model


class Pool(NamedTuple):
    cpu_budget: int     # bytes of pinned pool per rank
    bucket_bytes: int   # bytes per bucket


def state_bytes(model) -> int:
    """Bytes of optimizer state ZeroMuon keeps for ``model`` (all ranks together): fp32
    momentum (4 bytes per element) for Muon matrices, two fp32 Adam moments (8) for the rest."""
    from ..optim.param_rules import default_use_muon
    return sum((4 if default_use_muon(n, p) else 8) * p.numel()
               for n, p in model.named_parameters())


def streaming_pool(state_per_rank: int) -> Pool:
    """A pool smaller than ``state_per_rank`` bytes where the store allows it: 16 MiB of
    2 MiB buckets for state above 20 MiB, else ``POOL_BUCKETS`` buckets of a power of two
    near 1/16 of the state (at least ``MIN_BUCKET``; at 4 ranks or more the tiny preset's
    state is under that smallest pool and stays in it)."""
    if state_per_rank > LARGE_POOL * 5 // 4:
        return Pool(LARGE_POOL, LARGE_BUCKET)
    bucket = MIN_BUCKET
    while bucket * 2 <= min(state_per_rank // 16, LARGE_BUCKET):
        bucket *= 2
    return Pool(POOL_BUCKETS * bucket, bucket)


def demo_pool(preset: str, world_size: int) -> Pool:
    """The pool each of ``world_size`` ranks gets for model ``preset``."""
    from .model import build_model
    return streaming_pool(state_bytes(build_model(preset)) // world_size)
