"""Run a streaming statistics pass over a source: which keys, on how many threads.

torch's reductions run on one intra-op thread each: on a machine whose cores are busy with
other work, OpenMP threads spinning at barriers made the same reductions 50x slower
(measured: 0.05 vs 3-4 GB/s with one thread on two shared cores). Parallelism comes from
reducing several windows at once on worker threads instead (torch releases the GIL), one
accumulator table per thread, while the I/O threads keep reading ahead.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
from typing import Iterable, Sequence

import torch

from .model import TensorMeta
from .source import InspectSource, Progress
from .stats import ParallelStats


@contextlib.contextmanager
def single_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def select(tensors: Iterable[TensorMeta], names: Sequence[str] | None = None,
           states: Sequence[str] | None = None) -> list[tuple[TensorMeta, list[str]]]:
    """Tensors whose name matches any glob of ``names`` (all when empty), each with its
    states among ``states`` (all when empty); tensors left with no state are dropped."""
    out = []
    for t in tensors:
        if names and not any(fnmatch.fnmatchcase(t.name, g) for g in names):
            continue
        keep = [s for s in t.states if not states or s in states]
        if keep:
            out.append((t, keep))
    return out


def default_workers() -> int:
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else (os.cpu_count() or 1)))


def collect_stats(source: InspectSource, keys: Sequence[tuple[str, str]],
                  progress: Progress | None = None, workers: int | None = None
                  ) -> tuple[dict, int]:
    """Statistics of every ``(tensor, state)`` in ``keys``: ({key: stats dict}, bytes read).

    ``workers``: threads reducing windows at once (default: the CPUs, at most 4)."""
    workers = default_workers() if workers is None else workers
    table = ParallelStats(len(keys))
    with single_thread():
        nbytes = source.scan(keys, table.visit, progress, workers=workers)
    return {key: table.result(k) for k, key in enumerate(keys)}, nbytes
