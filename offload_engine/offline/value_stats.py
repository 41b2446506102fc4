"""Streaming statistics per (tensor, state), in float64 accumulators.

Data arrives as windows (1-D tensors of any dtype) with the pieces of each key they hold.
Each window is widened to float64 a block at a time (a fixed 8 MiB scratch buffer, so
memory does not grow with the input) and reduced per piece: torch reductions when a block
holds one piece, one numpy ``reduceat`` per statistic however many small tensors it holds.

Per key: ``count`` (elements), ``nan``, ``inf``, ``zeros`` (elements equal to 0), and over
the *finite* elements: ``sum``, ``sumsq``, ``min``, ``max``. Derived: ``mean`` and ``rms``
over the finite elements, ``l2`` = sqrt(sumsq), ``zero_fraction`` = zeros / count.
Non-finite values are counted, never summed, so one NaN does not hide the other numbers.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

# Elements widened to float64 at a time: 2 MiB, so the scratch stays in a core's L2 cache
# (measured single-threaded: 5.0 GB/s of fp32 input at 256 Ki elements, 3.9 at 1 Mi).
BLOCK = 1 << 18
_NATIVE = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # aminmax works on these


class StatsTable:
    """Accumulators for ``nkeys`` keys (index ``nkeys`` collects ignored gaps)."""

    def __init__(self, nkeys: int, block: int = BLOCK):
        n = nkeys + 1
        self.nkeys = nkeys
        self.count = np.zeros(n, np.int64)
        self.nan = np.zeros(n, np.int64)
        self.inf = np.zeros(n, np.int64)
        self.zeros = np.zeros(n, np.int64)
        self.sum = np.zeros(n, np.float64)
        self.sumsq = np.zeros(n, np.float64)
        self.min = np.full(n, np.inf)
        self.max = np.full(n, -np.inf)
        self.block = block
        self._wide = torch.empty(block, dtype=torch.float64)
        self._sq = np.empty(block, np.float64)

    # -- accumulation ----------------------------------------------------------------------
    def visit(self, data: torch.Tensor, pieces: list[tuple[int, int, int]]) -> None:
        """Add ``data[lo:hi]`` to key ``k`` for each ``(k, lo, hi)`` (sorted, disjoint)."""
        if not pieces:
            return
        lo_all = np.fromiter((p[1] for p in pieces), np.int64, len(pieces))
        hi_all = np.fromiter((p[2] for p in pieces), np.int64, len(pieces))
        keys_all = np.fromiter((p[0] for p in pieces), np.int64, len(pieces))
        start, stop = int(lo_all[0]), int(hi_all[-1])
        for b0 in range(start - start % self.block if start >= self.block else 0, stop, self.block):
            b1 = min(b0 + self.block, stop)
            i0 = int(np.searchsorted(hi_all, b0, side="right"))
            i1 = int(np.searchsorted(lo_all, b1, side="left"))
            if i0 >= i1:
                continue
            wide = self._wide[:b1 - b0]
            wide.copy_(data[b0:b1])
            y = wide.numpy()
            lo = np.maximum(lo_all[i0:i1], b0) - b0
            hi = np.minimum(hi_all[i0:i1], b1) - b0
            keys = keys_all[i0:i1]
            if len(keys) == 1:
                a, b = int(lo[0]), int(hi[0])
                self._one(wide[a:b], data[b0 + a:b0 + b], int(keys[0]))
            else:
                self._many(y, lo, hi, keys)

    def _one(self, w: torch.Tensor, src: torch.Tensor, k: int) -> None:
        """One key: torch reductions (numpy's BLAS ``dot`` fights torch's threads); min,
        max and zeros on the stored floats themselves (exact, half the bytes to read)."""
        n = w.numel()
        if not n:
            return
        s = w.sum().item()
        q = torch.dot(w, w).item()
        self.count[k] += n
        if math.isfinite(s) and math.isfinite(q):
            if src.dtype not in _NATIVE:
                src = w
            mn, mx = torch.aminmax(src)
            self.sum[k] += s
            self.sumsq[k] += q
            self.min[k] = min(self.min[k], mn.item())
            self.max[k] = max(self.max[k], mx.item())
            self.zeros[k] += n - int(torch.count_nonzero(src))
            return
        nanm, infm = torch.isnan(w), torch.isinf(w)
        self.nan[k] += int(nanm.sum())
        self.inf[k] += int(infm.sum())
        w = w[~(nanm | infm)]
        if not w.numel():
            return
        s = w.sum().item()
        q = torch.dot(w, w).item()
        mn, mx = torch.aminmax(w)
        self.sum[k] += s
        self.sumsq[k] += q
        self.min[k] = min(self.min[k], mn.item())
        self.max[k] = max(self.max[k], mx.item())
        self.zeros[k] += w.numel() - int(torch.count_nonzero(w))

    def _many(self, y: np.ndarray, lo: np.ndarray, hi: np.ndarray, keys: np.ndarray) -> None:
        n = y.size
        gap = self.nkeys
        m = len(keys)
        starts = np.empty(2 * m + 1, np.int64)
        ends = np.empty(2 * m + 1, np.int64)
        ks = np.full(2 * m + 1, gap, np.int64)
        starts[0], starts[1::2], starts[2::2] = 0, lo, hi
        ends[0::2][:m], ends[1::2], ends[-1] = lo, hi, n
        ks[1::2] = keys
        keep = ends > starts
        starts, ends, ks = starts[keep], ends[keep], ks[keep]
        sq = self._sq[:n]
        np.multiply(y, y, out=sq)
        s = np.add.reduceat(y, starts)
        q = np.add.reduceat(sq, starts)
        if np.isfinite(s.sum()) and np.isfinite(q.sum()):
            mn = np.minimum.reduceat(y, starts)
            mx = np.maximum.reduceat(y, starts)
        else:
            nanm, infm = np.isnan(y), np.isinf(y)
            fin = ~(nanm | infm)
            np.add.at(self.nan, ks, np.add.reduceat(nanm, starts, dtype=np.int64))
            np.add.at(self.inf, ks, np.add.reduceat(infm, starts, dtype=np.int64))
            yc = np.where(fin, y, 0.0)
            s = np.add.reduceat(yc, starts)
            np.multiply(yc, yc, out=sq)
            q = np.add.reduceat(sq, starts)
            mn = np.minimum.reduceat(np.where(fin, y, np.inf), starts)
            mx = np.maximum.reduceat(np.where(fin, y, -np.inf), starts)
        np.add.at(self.count, ks, ends - starts)
        np.add.at(self.sum, ks, s)
        np.add.at(self.sumsq, ks, q)
        np.minimum.at(self.min, ks, mn)
        np.maximum.at(self.max, ks, mx)
        np.add.at(self.zeros, ks, np.add.reduceat(y == 0, starts, dtype=np.int64))

    def merge(self, other: "StatsTable") -> None:
        """Add ``other``'s accumulators (another thread's share of the same keys)."""
        for name in ("count", "nan", "inf", "zeros", "sum", "sumsq"):
            getattr(self, name)[:] += getattr(other, name)
        np.minimum(self.min, other.min, out=self.min)
        np.maximum(self.max, other.max, out=self.max)

    # -- results ---------------------------------------------------------------------------
    def result(self, k: int) -> dict:
        """The statistics of key ``k`` as plain Python numbers (None where undefined)."""
        count = int(self.count[k])
        finite = count - int(self.nan[k]) - int(self.inf[k])
        sumsq = float(self.sumsq[k])
        return {
            "count": count,
            "min": float(self.min[k]) if finite else None,
            "max": float(self.max[k]) if finite else None,
            "mean": float(self.sum[k]) / finite if finite else None,
            "rms": math.sqrt(sumsq / finite) if finite else None,
            "l2": math.sqrt(sumsq),
            "nan": int(self.nan[k]),
            "inf": int(self.inf[k]),
            "zero_fraction": int(self.zeros[k]) / count if count else None,
            "sumsq": sumsq,
        }


class ParallelStats:
    """A ``StatsTable`` per thread, so windows can be reduced on several cores at once (torch
    and numpy release the GIL); ``result`` merges them. Sums then add up in an order that
    depends on scheduling: the last bits of mean, rms and L2 may differ between runs."""

    def __init__(self, nkeys: int, block: int = BLOCK):
        self.nkeys = nkeys
        self.block = block
        self._local = threading.local()
        self._tables: list[StatsTable] = []
        self._lock = threading.Lock()
        self._merged: StatsTable | None = None

    def visit(self, data: torch.Tensor, pieces: list[tuple[int, int, int]]) -> None:
        table = getattr(self._local, "table", None)
        if table is None:
            table = self._local.table = StatsTable(self.nkeys, self.block)
            with self._lock:
                self._tables.append(table)
        table.visit(data, pieces)

    def result(self, k: int) -> dict:
        if self._merged is None:
            merged = StatsTable(self.nkeys, block=1)
            for t in self._tables:
                merged.merge(t)
            self._merged = merged
        return self._merged.result(k)
