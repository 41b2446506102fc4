"""A pool sized for k held buckets holds any k, whatever the mix of full and short buckets.

A streamed bucket takes a whole slot of the pinned pool, however short (its array's last
bucket); cpu-homed buckets, kept for the store's life, come from the top of the pool. Before
this, short buckets placed first-fit could leave half the pool free in pieces no full bucket
fit, and an acquire waited until PoolExhaustedError (`demo --model moe` failed this way in CI).
"""

import random

import torch

from offload_engine.store import TieredStore

from helpers.store_runs import B

SLOT = 4 * B                 # bucket bytes
SHORT = 3 * B                # the last bucket of the arrays with a tail
FULL_ELEMS = SLOT // 4       # float32 elements in a full bucket


def _store(tmp_path, slots: int, **over) -> TieredStore:
    cfg = dict(nvme_paths=[str(tmp_path)], cpu_budget=slots * SLOT, bucket_bytes=SLOT,
               prefetch_depth=0, io_threads=2, queue_depth=2, acquire_timeout_s=3)
    cfg.update(over)
    return TieredStore(cfg)


def test_half_a_pool_free_in_short_pieces_still_takes_a_full_bucket(tmp_path):
    """The order that stranded CI: short, full, short, full taken first-fit leaves 32 KiB of
    a 64 KiB pool free as 12 + 12 + 8 KiB; with the two short buckets released, a third
    full bucket must still come in."""
    with _store(tmp_path, slots=4) as s:
        for name in ("a", "b"):                       # one full bucket and a 12 KiB tail each
            s.register(name, torch.float32, FULL_ELEMS + SHORT // 4)
        s.register("x", torch.float32, 3 * FULL_ELEMS)   # full buckets only
        tail_a = s.acquire("a", 1)
        full_0 = s.acquire("x", 0)
        tail_b = s.acquire("b", 1)
        full_1 = s.acquire("x", 1)
        for h in (tail_a, tail_b):
            h.tensor.fill_(7)
            s.release(h, dirty=True)
        full_2 = s.acquire("x", 2)                    # waited 3 s and raised before
        assert full_2.tensor.numel() == FULL_ELEMS
        for h in (full_0, full_1, full_2):
            s.release(h)
        tail_a = s.acquire("a", 1)                    # the evicted tail was written, and reads back
        assert bool((tail_a.tensor == 7).all())
        s.release(tail_a)


def test_any_mix_of_k_held_buckets_fits_a_pool_of_k_slots_beside_cpu_state(tmp_path):
    """Random acquires and releases of full and short buckets of NVMe-homed arrays, never
    more than the slots the pool has beyond its cpu-homed arrays held at once: every
    acquire succeeds and every bucket reads back what was last written to it."""
    rng = random.Random(20261204)
    slots, kept_bytes = 3, 5 * B                      # 5 pages of cpu-homed state, odd sizes
    with _store(tmp_path, slots=slots, cpu_budget=slots * SLOT + kept_bytes) as s:
        s.register("kept_a", torch.float32, 3 * B // 4, home="cpu")
        s.register("kept_b", torch.float32, 2 * B // 4, home="cpu")
        names = []
        for i, tail in enumerate((0, B, 2 * B, 3 * B, B, 2 * B)):
            names.append(f"m{i}")
            s.register(names[-1], torch.float32, 2 * FULL_ELEMS + tail // 4)
        expected: dict = {}
        held: list = []
        for op in range(400):
            if op % 37 == 5:                          # cpu-homed state touched among the streams
                h = s.acquire(rng.choice(("kept_a", "kept_b")), 0)
                s.release(h)
            if held and (len(held) == slots or rng.random() < 0.5):
                key, h = held.pop(rng.randrange(len(held)))
                value = float(op)
                h.tensor.fill_(value)
                expected[key] = value
                s.release(h, dirty=True)
                continue
            name = rng.choice(names)
            index = rng.randrange(len(s.bucket_ranges(name)))
            if any(k == (name, index) for k, _ in held):
                continue
            h = s.acquire(name, index)
            assert bool((h.tensor == expected.get((name, index), 0.0)).all()), (name, index)
            held.append(((name, index), h))
        for _, h in held:
            s.release(h)
