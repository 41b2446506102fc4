import gc
import threading
import time

import pytest
import torch

from offload_engine.io import (ALIGN, BufferPool, PoolExhaustedError, RequestTooLargeError)


def test_buffers_are_page_aligned_views_of_one_arena():
    pool = BufferPool(1 << 20)
    base = pool._arena.data_ptr()
    bufs = [pool.acquire(n) for n in (1, 4095, 4096, 5000, 100_000)]
    for b in bufs:
        assert b.data_ptr() % ALIGN == 0
        assert base <= b.data_ptr() < base + pool.capacity  # no allocation outside the arena
    ends = sorted((b.offset, b.offset + b.capacity) for b in bufs)
    for (_, end), (start, _) in zip(ends, ends[1:]):
        assert end <= start  # no two buffers overlap
    assert pool.in_use == sum(b.capacity for b in bufs)
    for b in bufs:
        b.release()
    assert pool.in_use == 0 and pool.live_buffers == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.int32, torch.uint8])
def test_views_of_any_dtype_share_memory(dtype):
    pool = BufferPool(1 << 16)
    with pool.acquire(1000) as buf:
        t = buf.view(dtype)
        assert t.dtype == dtype and t.numel() == 1000 // t.element_size()
        t.fill_(3)
        again = buf.view(dtype, 10)
        assert again.data_ptr() == t.data_ptr() and bool((again == 3).all())
        with pytest.raises(ValueError, match="need"):
            buf.view(dtype, 10**6)


def test_request_larger_than_budget_fails_at_once():
    pool = BufferPool(64 << 10)
    t0 = time.monotonic()
    with pytest.raises(RequestTooLargeError, match="can never fit"):
        pool.acquire((64 << 10) + 1, timeout=60)
    assert time.monotonic() - t0 < 1.0


def test_exhaustion_times_out_with_clear_error():
    pool = BufferPool(64 << 10)
    held = pool.acquire(48 << 10)
    with pytest.raises(PoolExhaustedError, match="held by 1 unreleased"):
        pool.acquire(32 << 10, timeout=0.2)
    held.release()
    pool.acquire(32 << 10, timeout=0.2).release()


def test_acquire_waits_for_a_release_from_another_thread():
    pool = BufferPool(64 << 10)
    held = pool.acquire(64 << 10)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(16 << 10, timeout=10)))
    t.start()
    time.sleep(0.1)
    assert not got
    held.release()
    t.join(5)
    assert got and got[0].nbytes == 16 << 10


def test_release_coalesces_so_the_whole_budget_is_usable_again():
    pool = BufferPool(1 << 20)
    bufs = [pool.acquire(4096 * (i % 5 + 1)) for i in range(30)]
    for b in bufs[::2] + bufs[1::2]:
        b.release()
    whole = pool.acquire(pool.capacity, timeout=0)
    assert whole.offset == 0
    whole.release()
    assert pool.peak_in_use == pool.capacity


def test_double_release_and_use_after_release_are_errors():
    pool = BufferPool(1 << 16)
    b = pool.acquire(10)
    b.release()
    with pytest.raises(RuntimeError, match="twice"):
        b.release()
    with pytest.raises(RuntimeError, match="after release"):
        b.view(torch.float32)


def test_pinning_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pool = BufferPool(1 << 16)
        assert pool.pinned
        return
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        BufferPool(1 << 16, pin=True)
    assert not BufferPool(1 << 16).pinned


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs CUDA")
def test_a_pool_dropped_without_close_unpins_its_arena():
    # its arena is unmapped with it; a later pool mapped at the same address must pin
    for _ in range(4):
        pool = BufferPool(1 << 16)
        assert pool.pinned
        pool.acquire(1000).view(torch.float32).fill_(1)
        del pool
        gc.collect()


def _vma_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address`` (/proc/self/smaps).

    The kernel merges an arena with a neighbouring anonymous mapping of the same flags (an
    earlier test's), so the mapping may start below the arena: the flags are the same."""
    found = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= address < hi
            elif found and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_HUGEPAGE"), reason="no THP (not Linux)")
def test_a_pool_of_huge_page_size_asks_for_huge_pages_on_a_huge_page_boundary(monkeypatch):
    # an O_DIRECT request is cut into one device request per physically contiguous run of
    # its buffer: 4 KiB pages turned 4 MiB reads into 512 KiB device requests (docs/store.md)
    from offload_engine.io.align import HUGE_PAGE, HUGE_PAGES_ENV

    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    with BufferPool(3 * HUGE_PAGE + ALIGN) as pool:  # not a whole number of huge pages
        assert pool.address % HUGE_PAGE == 0
        assert "hg" in _vma_flags(pool.address)  # madvise(MADV_HUGEPAGE) is in effect
        buf = pool.acquire(3 * HUGE_PAGE + ALIGN)  # the whole budget is still there
        buf.bytes.view(-1)[:] = 7
        assert int(buf.bytes.view(-1)[-1]) == 7
        buf.release()
    with BufferPool(HUGE_PAGE // 2) as small:  # below a huge page: ordinary pages
        assert "hg" not in _vma_flags(small.address)
    monkeypatch.setenv(HUGE_PAGES_ENV, "0")
    with BufferPool(4 * HUGE_PAGE) as plain:  # turned off: ordinary pages
        assert "hg" not in _vma_flags(plain.address)


def test_acquire_with_reserve_holds_a_whole_slot_so_slots_never_fragment():
    """Windows of uneven length, each reserving a whole slot: a freed slot takes the next
    window whatever its length, so the lowest slots are reused and none is left too short."""
    slot = 64 * 1024
    pool = BufferPool(3 * slot)
    a = pool.acquire(slot - 4096, reserve=slot)
    b = pool.acquire(slot, reserve=slot)
    assert a.nbytes == slot - 4096 and a.capacity == slot and b.offset == slot
    a.release()
    c = pool.acquire(slot, reserve=slot)  # a full window fits where a short one was
    assert c.offset == 0
    assert pool.acquire(1, reserve=slot).offset == 2 * slot
    with pytest.raises(RequestTooLargeError):
        pool.acquire(1, reserve=4 * slot)


def test_prefault_makes_the_whole_arena_resident():
    psutil = pytest.importorskip("psutil")
    size = 64 << 20
    with BufferPool(size, pin=False) as pool:
        before = psutil.Process().memory_info().rss
        pool.prefault()
        grown = psutil.Process().memory_info().rss - before
    assert grown >= size * 0.9, f"prefault of {size} bytes grew RSS by {grown} bytes"


def test_prefault_of_a_range_touches_that_range_only():
    psutil = pytest.importorskip("psutil")
    size, part = 64 << 20, 16 << 20
    with BufferPool(size, pin=False) as pool:
        before = psutil.Process().memory_info().rss
        pool.prefault(size // 2, part)
        grown = psutil.Process().memory_info().rss - before
    assert part * 0.9 <= grown < part * 1.5, f"prefault of {part} bytes grew RSS by {grown} bytes"
