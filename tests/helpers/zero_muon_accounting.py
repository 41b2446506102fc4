"""What a ZeroMuon step may move, checked from inside a rank: no collective but all_to_all_single
runs in a step, and the store reads and writes each bucket once per step."""

from __future__ import annotations

import torch.distributed as dist

from helpers.zero_muon_harness import set_grads


FORBIDDEN = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
             "reduce_scatter_tensor", "broadcast", "all_gather_object", "gather", "scatter")


def forbid_other_collectives():
    """Make every collective but all_to_all_single raise; returns the originals."""
    saved = {}
    for name in FORBIDDEN:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def boom(*a, _n=name, **k):
            raise AssertionError(f"ZeroMuon.step called dist.{_n}")
        setattr(dist, name, boom)
    return saved


def bucket_sizes(store):
    sizes = {}
    for name, arr in store.arrays().items():
        for i, (a, b) in enumerate(store.bucket_ranges(name)):
            sizes[(name, i)] = (b - a) * arr.itemsize
    return sizes


def check_store_pass(opt, model, ref, rank, world, steps=5):
    """Every bucket written once per step; every bucket not cached at step start read once."""
    store = opt.store
    sizes = bucket_sizes(store)
    total = sum(sizes.values())
    set_grads(model, ref, 0, rank, world)
    opt.step()                      # first step: zero-filled, nothing to read
    store.flush()
    store.stats(reset=True)
    cached_seen = False
    for step in range(1, steps):
        cached = sum(sizes[k] for k in store.resident_buckets())
        cached_seen |= 0 < cached < total
        set_grads(model, ref, step, rank, world)
        opt.step()
        st = opt.last_step_stats
        store.flush()               # write-behind of this step lands in this step's count
        late = store.stats(reset=True)
        read = st.store_bytes_read["nvme"] + late.bytes_read["nvme"]
        written = st.store_bytes_written["nvme"] + late.bytes_written["nvme"]
        assert written == total, (step, written, total)
        assert read == total - cached, (step, read, total, cached)
    assert cached_seen, "the test should cache part of the state, not all or none"
