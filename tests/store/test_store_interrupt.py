"""Ctrl-C while the store starts an I/O (issue 30, item 1): the interrupt reaches the caller,
and the store's bookkeeping still hears how that I/O ended, so flush() and close() return
and no byte is lost. Before the fix, a KeyboardInterrupt raised inside the start of a
write-back left the write-backs-in-flight count raised and close() waited forever."""

import threading

import pytest
import torch

from helpers.deadline import within
from helpers.store_runs import make_store
from offload_engine.layout.flat_array import FlatArray

KiB = 1024
BUCKET = 16 * KiB
BUCKETS = 16


def interrupt_first_call_on_this_thread(monkeypatch, method):
    """``FlatArray.<method>`` raises KeyboardInterrupt the first time the test's own thread
    calls it (where Ctrl-C lands: Python delivers it to the main thread)."""
    original = getattr(FlatArray, method)
    main, fired = threading.get_ident(), []

    def interrupted(self, *args, **kwargs):
        if threading.get_ident() == main and not fired:
            fired.append(True)
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FlatArray, method, interrupted)
    return fired


def touch_every_bucket(store, add):
    for i in range(BUCKETS):
        h = store.acquire("m", i)
        h.tensor.add_(add)
        store.release(h, dirty=True)


@pytest.mark.parametrize("method", ["write_from", "read_into"])
def test_ctrl_c_while_an_io_starts_leaves_flush_and_close_working(tmp_path, monkeypatch,
                                                                   method):
    store = make_store(tmp_path, cpu_budget=64 * KiB, bucket_bytes=BUCKET, prefetch_depth=0)
    numel = BUCKETS * BUCKET // 4
    store.register("m", torch.float32, numel)
    touch_every_bucket(store, 1.0)  # every bucket written home at least once: reads follow
    store.flush()
    fired = interrupt_first_call_on_this_thread(monkeypatch, method)
    with pytest.raises(KeyboardInterrupt):
        for _ in range(3):
            touch_every_bucket(store, 1.0)
    assert fired, f"no {method} ran on the main thread: the test exercised nothing"
    monkeypatch.undo()

    # the interrupted I/O ended as failed, not as "still in flight": flush writes every
    # dirty bucket home and returns; every value is one the loop gave it (1 + k steps)
    within(30, store.flush)
    values = []
    for i in range(BUCKETS):
        h = store.acquire("m", i)
        values.append(h.tensor.clone())
        store.release(h)
    for v in values:
        assert torch.all(v == v[0]) and v[0].item() in (1.0, 2.0, 3.0, 4.0), v[:4]
    within(30, store.close)


def test_an_interrupted_write_back_keeps_its_bytes(tmp_path, monkeypatch):
    """The bucket whose write-back was interrupted is still dirty: the next flush writes it,
    and a new store on the same directory reads the bytes the caller last wrote."""
    store = make_store(tmp_path, cpu_budget=64 * KiB, bucket_bytes=BUCKET, prefetch_depth=0)
    numel = BUCKETS * BUCKET // 4
    store.register("m", torch.float32, numel)
    interrupt_first_call_on_this_thread(monkeypatch, "write_from")
    written = {}
    with pytest.raises(KeyboardInterrupt):
        for step in range(1, 4):
            for i in range(BUCKETS):
                h = store.acquire("m", i)
                h.tensor.fill_(step * 100 + i)
                written[i] = step * 100 + i
                store.release(h, dirty=True)
    monkeypatch.undo()
    within(30, store.flush)
    within(30, store.close)

    again = make_store(tmp_path, cpu_budget=64 * KiB, bucket_bytes=BUCKET, prefetch_depth=0)
    again.register("m", torch.float32, numel)
    for i in range(BUCKETS):
        h = again.acquire("m", i)
        want = written.get(i, 0)
        assert torch.all(h.tensor == want), (i, h.tensor[:2], want)
        again.release(h)
    again.close()
