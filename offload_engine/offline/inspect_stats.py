"""Run a streaming statistics pass over a source: which keys, on how many threads.

torch's reductions run on one intra-op thread each: on a machine whose cores are busy with
other work, OpenMP threads spinning at barriers made the same reductions 50x slower
(measured: 0.05 vs 3-4 GB/s with one thread on two shared cores). Parallelism comes from
reducing several windows at once on worker threads instead (torch releases the GIL), one
accumulator table per thread, while the I/O threads keep reading ahead.
"""

from __future__ import annotations

import contextlib
import os
from typing import Sequence

import torch

from ..formats.source import Progress, TensorSource
from .value_stats import ParallelStats


@contextlib.contextmanager
def single_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def default_workers() -> int:
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else (os.cpu_count() or 1)))


def collect_stats(source: TensorSource, keys: Sequence[tuple[str, str]],
                  progress: Progress | None = None, workers: int | None = None
                  ) -> tuple[dict, int]:
    """Statistics of every ``(tensor, state)`` in ``keys``: ({key: stats dict}, bytes read).

    ``workers``: threads reducing windows at once (default: the CPUs, at most 4)."""
    workers = default_workers() if workers is None else workers
    table = ParallelStats(len(keys))
    with single_thread():
        nbytes = source.scan(keys, table.visit, progress, workers=workers)
    return {key: table.result(k) for k, key in enumerate(keys)}, nbytes
