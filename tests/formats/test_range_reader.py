"""Reads of many small element ranges (``RangeReader``, what consolidate, load, diff and export
use on our format) are right in any order and cost few disk reads in storage order.

A mixture-of-experts checkpoint holds ~100,000 tensors of a few hundred bytes per rank; read
one by one from the disk, each cost a read and a wake-up of the I/O threads (a minute for a
100 MB consolidate). What a user relies on: the bytes are the array's, a corrupt chunk is
still caught, and reading in storage order goes at the disk's pace (few, large reads) with
memory bounded by the cache's budget whatever the array's size.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from offload_engine.layout.checksums import ChecksumError, crc32c_extend
from offload_engine.formats.ours.block_cache import BlockCache
from offload_engine.formats.ours.windows import ChunkedArray, RangeReader
from offload_engine.io import AsyncFileIO, BufferPool
from offload_engine.layout import FlatArray

KiB = 1 << 10
WINDOW = 64 * KiB
CACHE = 4 * WINDOW  # max block: one window


def make_array(path, io, numel, chunk_bytes, seed, checksummed=True):
    """A float32 array of random values in ``chunk_bytes`` chunk files, with the crc32c of
    each file as a checkpoint's manifest records them (or none)."""
    flat = FlatArray.create(path, numel, "float32", io=io, chunk_bytes=chunk_bytes)
    values = np.random.default_rng(seed).standard_normal(numel).astype(np.float32)
    flat.write_from(0, numel, memoryview(values).cast("B")).result()
    crcs = None
    if checksummed:
        crcs = []
        for c in range(-(-numel * 4 // flat.chunk_bytes)):
            with open(flat.chunk_path(c), "rb") as f:
                crcs.append(crc32c_extend(0, f.read()))
    return ChunkedArray(os.path.basename(str(path)), flat, crcs), values


def read_range(reader, array, lo, hi):
    out = np.empty(hi - lo, dtype=np.float32)
    reader.read(array, lo, hi, memoryview(out).cast("B"))
    return out


@pytest.fixture
def io():
    with AsyncFileIO(threads=4) as io:
        yield io


@pytest.fixture
def reader(io):
    pool = BufferPool(2 * WINDOW)
    r = RangeReader(io, pool, WINDOW, cache_bytes=CACHE)
    yield r
    r.close()
    pool.close()


@pytest.mark.parametrize("checksummed", [True, False])
def test_small_ranges_in_storage_order_take_few_large_reads(tmp_path, io, reader, checksummed):
    # 2 MiB in 1 MiB chunks, 8x the cache: 4,096 tensors of 128 elements (512 bytes)
    numel, piece = 512 * KiB, 128
    array, values = make_array(tmp_path / "a", io, numel, 1 << 20, 0, checksummed)
    io.reset_stats()
    for lo in range(0, numel, piece):
        np.testing.assert_array_equal(read_range(reader, array, lo, lo + piece),
                                      values[lo:lo + piece])
    stats = io.reset_stats()
    data = numel * 4
    verify = data if checksummed else 0
    # one read per tensor would be 4,096; blocks grow to a window (64 KiB) within a few
    # misses of each chunk: about data / window reads, and the bytes read close to the data
    assert stats.reads <= verify // WINDOW + 2 * data // WINDOW + 16, stats
    assert stats.bytes_read <= verify + data + 2 * WINDOW, stats


def test_interleaved_arrays_in_random_order_read_right(tmp_path, io, reader):
    arrays = [make_array(tmp_path / f"rank{r}", io, 300_000 + 17 * r, 256 * KiB, r)
              for r in range(6)]  # more arrays read in turn than the cache holds blocks
    rng = random.Random(0)
    ranges = []
    for i, (array, values) in enumerate(arrays):
        cuts = sorted(rng.sample(range(1, len(values)), 400)) + [len(values)]
        ranges += [(i, lo, hi) for lo, hi in zip([0] + cuts[:-1], cuts)]
    storage_order = sorted(ranges, key=lambda r: (r[1], r[0]))  # ranks in turn
    data = sum(len(values) * 4 for _, values in arrays)
    moved = []
    for order in (storage_order, rng.sample(ranges, len(ranges))):
        io.reset_stats()
        for i, lo, hi in order:
            array, values = arrays[i]
            np.testing.assert_array_equal(read_range(reader, array, lo, hi), values[lo:hi])
        moved.append(io.reset_stats().bytes_read)
    # more arrays in turn than the cache holds blocks: they shrink rather than be read again
    # and again at full size (64 KiB for each ~3 KB range would be ~20x the data); the
    # first pass also verifies every chunk (the data once more)
    assert moved[0] <= 4 * data, (moved, data)


def test_a_corrupt_chunk_is_caught_before_any_of_its_bytes_are_served(tmp_path, io, reader):
    array, values = make_array(tmp_path / "a", io, 200_000, 256 * KiB, 1)
    path = array.flat.chunk_path(1)
    with open(path, "r+b") as f:
        f.seek(100_000)
        byte = f.read(1)
        f.seek(100_000)
        f.write(bytes([byte[0] ^ 1]))
    np.testing.assert_array_equal(read_range(reader, array, 0, 1000), values[:1000])
    chunk_elems = array.flat.chunk_elems
    with pytest.raises(ChecksumError, match=os.path.basename(path)):
        read_range(reader, array, chunk_elems + 5, chunk_elems + 10)


def test_read_ahead_grows_in_order_shrinks_on_thrash_and_resets_on_a_jump():
    cache = BlockCache(1 << 20, max_block=256 * KiB, min_block=16 * KiB)
    key, limit = ("a", 0), 4 << 20
    sizes, offset = [], 0
    for _ in range(6):
        start, end = cache.plan(key, offset, limit)
        sizes.append(end - start)
        offset = end
    assert sizes == [16 * KiB, 32 * KiB, 64 * KiB, 128 * KiB, 256 * KiB, 256 * KiB]
    start, end = cache.plan(key, offset - 4096, limit)  # inside the last block: evicted early
    assert end - start == 128 * KiB
    start, end = cache.plan(key, 3 << 20, limit)  # a jump
    assert (start, end - start) == (3 << 20, 16 * KiB)
    block = cache.insert(key, 1 << 20, (1 << 20) + 8192)
    assert cache.plan(key, (1 << 20) - 4096, limit) == ((1 << 20) - 4096, 1 << 20)  # stops short
    assert cache.find(key, (1 << 20) + 100) is block
    assert cache.find(key, (1 << 20) + 8192) is None
    cache.close()


def test_blocks_are_evicted_least_recently_used_within_the_budget():
    cache = BlockCache(64 * KiB, max_block=32 * KiB, min_block=16 * KiB)
    a = cache.insert(("a", 0), 0, 32 * KiB)
    b = cache.insert(("b", 0), 0, 32 * KiB)
    assert cache.find(("a", 0), 5) is a  # a is now the most recent
    c = cache.insert(("c", 0), 0, 32 * KiB)
    assert cache.find(("b", 0), 5) is None and cache.find(("a", 0), 5) is a
    assert cache.find(("c", 0), 32 * KiB - 1) is c
    assert cache.insert(("d", 0), 0, 128 * KiB) is None  # larger than the budget
    cache.close()
