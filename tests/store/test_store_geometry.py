"""Bucket geometry (offload_engine/store/geometry.py): the one place that cuts arrays into
buckets and sizes them in the pinned pool, against what the store and the pool really do."""

import pytest
import torch

from offload_engine.dtypes import dtype as dtype_of
from offload_engine.io import BufferPool
from offload_engine.optim.state_layout import ArrayKey, StateKind
from offload_engine.plan.memory import ArrayPlan
from offload_engine.store import TieredStore
from offload_engine.store.geometry import (array_pool_bytes, bucket_sizes, bucket_spans,
                                           elems_per_bucket, itemsize_of, pool_bytes)
from offload_engine.units import PAGE


def test_spans_sizes_and_elements():
    assert itemsize_of(torch.bfloat16) == itemsize_of("bfloat16") == itemsize_of(2) == 2
    assert elems_per_bucket(8192, torch.float32) == 2048
    assert bucket_spans(5000, torch.float32, 8192) == [(0, 2048), (2048, 4096), (4096, 5000)]
    assert bucket_sizes(5000, torch.float32, 8192) == [8192, 8192, 3616]
    assert bucket_spans(0, torch.float32, 8192) == [] and array_pool_bytes(0, 4, 8192) == 0
    assert pool_bytes(1) == pool_bytes(PAGE) == PAGE and pool_bytes(PAGE + 1) == 2 * PAGE
    assert pool_bytes(0) == PAGE                 # the pool never hands out an empty buffer
    assert array_pool_bytes(5000, torch.float32, 8192) == 8192 + 8192 + PAGE


@pytest.mark.parametrize("nbytes", [1, 100, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 17])
def test_pool_bytes_is_what_the_pinned_pool_carves_out(nbytes):
    with BufferPool(16 * PAGE) as pool:
        buf = pool.try_acquire(nbytes)
        assert buf.capacity == pool.in_use == pool_bytes(nbytes)
        buf.release()


@pytest.mark.parametrize("dtype, numel", [(torch.float32, 10_000), (torch.bfloat16, 12_345),
                                          (torch.int64, 3), (torch.float32, 4096)])
def test_the_store_and_the_planner_cut_arrays_the_same_way(tmp_path, dtype, numel):
    bucket = 8192
    with TieredStore({"nvme_paths": [str(tmp_path)], "bucket_bytes": bucket,
                      "cpu_budget": 64 * bucket}) as store:
        store.register("a", dtype, numel, home="cpu")
        assert store.bucket_ranges("a") == bucket_spans(numel, dtype, bucket)
        for i in range(len(store.bucket_ranges("a"))):
            store.release(store.acquire("a", i))
        assert store.pool.in_use == array_pool_bytes(numel, dtype, bucket)
    plan = ArrayPlan(ArrayKey(StateKind.MOMENTUM, dtype_of(dtype)), numel, bucket)
    assert plan.buckets() == bucket_sizes(numel, dtype, bucket)
    assert plan.pinned_bytes == array_pool_bytes(numel, dtype, bucket)
