"""The interface every input kind implements, and the generic streaming scan.

A source lists its logical tensors from metadata only (``tensors()``), reads any element
range of a tensor's state, reassembled from its shards (``read``), and streams the states
asked for through fixed buffers (``scan``). Sources whose data lies in large contiguous
arrays (stores, checkpoints) override ``scan`` to read in storage order.
"""

from __future__ import annotations

import concurrent.futures
from typing import Callable, Sequence

import torch

from offload_engine.io import BufferPool

from .errors import InspectError
from .model import SourceInfo, TensorMeta

MiB = 1 << 20

# visit(data, pieces): ``data`` a 1-D tensor of a state's dtype; ``pieces`` a list of
# (key index, lo, hi): data[lo:hi] are elements of key ``keys[key index]``.
Visit = Callable[[torch.Tensor, list], None]
Progress = Callable[[int, int], None]


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class InspectSource:
    """Base class: subclasses set ``info`` and implement ``tensors``, ``read``, ``close``."""

    info: SourceInfo

    def tensors(self) -> list[TensorMeta]:
        raise NotImplementedError

    def aliases(self) -> dict[str, str]:
        """Tied names ``{alias: owner}`` (DeepSpeed's shared_params, safetensors metadata)."""
        return {}

    def read(self, name: str, state: str, start: int, out: torch.Tensor) -> None:
        """Fill ``out`` (1-D, contiguous, the state's dtype) with elements
        ``[start, start + out.numel())`` of the flattened state."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers ---------------------------------------------------------------------------
    def tensor(self, name: str) -> TensorMeta:
        for t in self.tensors():
            if t.name == name:
                return t
        owner = self.aliases().get(name)
        if owner is not None:
            return self.tensor(owner)
        raise InspectError(f"{self.info.path}: no tensor named {name!r}")

    def scan(self, keys: Sequence[tuple[str, str]], visit: Visit, progress: Progress | None = None,
             window_bytes: int = 16 * MiB, workers: int = 1) -> int:
        """Stream every element of each ``(tensor, state)`` in ``keys`` to ``visit``; returns
        the bytes read. Generic version: tensor by tensor, the next window read on a
        helper thread while ``visit`` works on the current one (``workers`` is ignored:
        ``visit`` runs on the calling thread)."""
        metas = {t.name: t for t in self.tensors()}
        jobs = []
        for k, (name, state) in enumerate(keys):
            sm = metas[name].states[state]
            per = max(1, window_bytes // itemsize(sm.dtype))
            jobs += [(k, name, state, sm.dtype, lo, min(sm.numel, lo + per))
                     for lo in range(0, sm.numel, per)]
        total = sum((hi - lo) * itemsize(dt) for _, _, _, dt, lo, hi in jobs)
        done = 0
        pool = BufferPool(2 * window_bytes + 8192)
        ex = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="oe-inspect-read")
        try:
            def fetch(job):
                k, name, state, dtype, lo, hi = job
                nbytes = (hi - lo) * itemsize(dtype)
                buf = pool.acquire(nbytes)
                try:
                    data = buf.view(dtype, hi - lo)
                    self.read(name, state, lo, data)
                except BaseException:
                    buf.release()
                    raise
                return buf, data

            nxt = ex.submit(fetch, jobs[0]) if jobs else None
            for i, job in enumerate(jobs):
                buf, data = nxt.result()
                nxt = ex.submit(fetch, jobs[i + 1]) if i + 1 < len(jobs) else None
                try:
                    visit(data, [(job[0], 0, data.numel())])
                finally:
                    buf.release()
                done += data.numel() * data.element_size()
                if progress:
                    progress(done, total)
        finally:
            if nxt is not None:
                try:
                    nxt.result()[0].release()
                except BaseException:
                    pass
            ex.shutdown(wait=True)
            pool.close()
        return done
