"""Bucket geometry: how a flat array is cut into buckets and what they take in the pinned pool.

A store array of ``numel`` elements is cut into buckets of ``bucket_bytes // itemsize``
elements each, the last one shorter; bucket ``i`` is also chunk file ``i`` on NVMe. Each
resident bucket holds one buffer of the pinned pool, rounded up to whole pages (``PAGE``
bytes: the pool hands out page-aligned extents so O_DIRECT can read into them).

This is the one place for that arithmetic. ``TieredStore.register`` cuts arrays with it,
ZeroMuon sizes its default pool with it, and the planner's step replay
(``plan/step_sim.py``) sizes its model pool with it; the optimizer's layout
(``optim/state_layout.py``, ``optim/pool_budget.py``) and the planner's byte model
(``plan/memory.py``) and the checkpoint writer (its chunk files match the buckets) do too. Pure integer arithmetic: no torch, nothing else
imported but the dtype table.
"""

from __future__ import annotations

from .. import dtypes
from ..units import PAGE


def itemsize_of(dtype) -> int:
    """Bytes per element of ``dtype``: an int (itself) or anything ``dtypes.dtype`` takes
    (a torch or numpy dtype, a name such as "bfloat16")."""
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        return dtype
    return dtypes.itemsize(dtype)


def elems_per_bucket(bucket_bytes: int, dtype) -> int:
    """Elements in a full bucket of ``bucket_bytes`` bytes of ``dtype``."""
    return bucket_bytes // itemsize_of(dtype)


def bucket_spans(numel: int, dtype, bucket_bytes: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` element ranges of the buckets of an array of ``numel`` elements
    (none for an empty array; the last one shorter when ``numel`` is not a multiple)."""
    be = elems_per_bucket(bucket_bytes, dtype)
    return [(start, min(start + be, numel)) for start in range(0, numel, be)]


def bucket_sizes(numel: int, dtype, bucket_bytes: int) -> list[int]:
    """Bytes of each bucket of an array of ``numel`` elements of ``dtype``."""
    size = itemsize_of(dtype)
    return [(stop - start) * size for start, stop in bucket_spans(numel, dtype, bucket_bytes)]


def pool_bytes(nbytes: int) -> int:
    """Pinned-pool bytes one buffer of ``nbytes`` bytes takes: whole pages, at least one
    (what ``io.BufferPool`` carves out for it)."""
    return max(-(-nbytes // PAGE) * PAGE, PAGE)


def array_pool_bytes(numel: int, dtype, bucket_bytes: int) -> int:
    """Pinned-pool bytes all buckets of an array of ``numel`` elements take when resident
    (each bucket page-rounded; 0 for an empty array)."""
    size = itemsize_of(dtype)
    full, rem = divmod(numel, elems_per_bucket(bucket_bytes, dtype))
    full_bytes = elems_per_bucket(bucket_bytes, dtype) * size
    return full * pool_bytes(full_bytes) + (pool_bytes(rem * size) if rem else 0)
