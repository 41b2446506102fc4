"""A small nvme-backed TieredStore whose budget forces eviction, and steps that touch every
bucket of one array the way the optimizer does."""

from offload_engine.store import TieredStore

B = 4096  # bucket bytes in these tests: small so budgets force eviction


def make_store(path, **over):
    cfg = dict(nvme_paths=[str(path)], cpu_budget=5 * B, bucket_bytes=B, prefetch_depth=2,
               io_threads=2, queue_depth=2, acquire_timeout_s=5)
    cfg.update(over)
    return TieredStore(cfg)


def run_steps(store, name, steps, fn=None):
    """Each step: acquire every bucket in the store's order, add 1, release dirty."""
    nb = len(store.bucket_ranges(name))
    out = []
    for _ in range(steps):
        order = store.begin_step() or [(name, i) for i in range(nb)]
        for key in order:
            h = store.acquire(*key)
            h.tensor.add_(1)
            store.release(h, dirty=True)
        out.append(store.stats(reset=True))
    return out
