"""How a bucket takes room in the store's pinned pool.

A streamed (NVMe-homed) bucket, however short, takes a whole bucket's slot, first-fit from
the bottom of the pool; a bucket homed on the CPU, kept for the store's life, takes its own
page-rounded size from the top (io/extents.py). Equal slots cannot fragment, so a pool sized
for the cpu-homed state plus k buckets holds any k buckets at once. With every buffer placed
first-fit at its own size, short buckets could leave half the pool free in pieces no full
bucket fit, and an acquire waited into PoolExhaustedError with nothing held beyond its share.
"""

from __future__ import annotations

from .bucket import Bucket
from .geometry import pool_bytes


def slot_bytes(bucket_bytes: int, pool_capacity: int) -> int:
    """Bytes of one streamed bucket's slot: a full bucket, page-rounded (at most the pool)."""
    return min(pool_bytes(bucket_bytes), pool_capacity)


def room_needed(b: Bucket, slot: int) -> int:
    """Pool bytes ``b``'s buffer takes (what a write-back must free to make room for it)."""
    return pool_bytes(b.nbytes) if b.pinned_home else slot


def take_buffer(pool, b: Bucket, slot: int):
    """``b``'s buffer from ``pool`` (a BufferPool) if there is room now, else None."""
    if b.pinned_home:
        return pool.try_acquire(b.nbytes, top=True)
    return pool.try_acquire(b.nbytes, reserve=slot)
