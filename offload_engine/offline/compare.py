"""Element-wise comparison of two streams of values, in float64 accumulators.

``a`` is compared with the reference ``b`` as numpy's ``isclose`` does:
``|a - b| <= atol + rtol * |b|``; NaN equals NaN and an infinity equals the same
infinity (a checkpoint compared with its own copy is equal). Reported: ``mismatches``
(elements outside the tolerance), ``max_abs`` (largest |a - b| over finite pairs, inf
when a non-finite value differs), and ``rel_l2`` = ||a - b|| / ||b|| over finite pairs.
"""

from __future__ import annotations

import math

import torch

BLOCK = 1 << 20


class Comparison:
    def __init__(self, rtol: float, atol: float, block: int = BLOCK):
        self.rtol, self.atol = rtol, atol
        self.count = 0
        self.mismatches = 0
        self.max_abs = 0.0
        self.diff_sq = 0.0
        self.ref_sq = 0.0
        self._a = torch.empty(block, dtype=torch.float64)
        self._b = torch.empty(block, dtype=torch.float64)
        self.block = block

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Compare ``a`` with ``b`` (1-D, same length, any dtypes)."""
        for lo in range(0, a.numel(), self.block):
            hi = min(a.numel(), lo + self.block)
            x, y = self._a[:hi - lo], self._b[:hi - lo]
            x.copy_(a[lo:hi])
            y.copy_(b[lo:hi])
            self._block(x, y)

    def _block(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.count += x.numel()
        d = (x - y).abs_()
        fin = torch.isfinite(d)
        if bool(fin.all()):
            close = d <= self.atol + self.rtol * y.abs()
            self.mismatches += int((~close).sum())
            if d.numel():
                self.max_abs = max(self.max_abs, float(d.max()))
            self.diff_sq += float(torch.dot(d, d))
            self.ref_sq += float(torch.dot(y, y))
            return
        same = (torch.isnan(x) & torch.isnan(y)) | (torch.isinf(x) & (x == y))
        close = (fin & (d <= self.atol + self.rtol * y.abs())) | same
        self.mismatches += int((~close).sum())
        if bool((~fin & ~same).any()):
            self.max_abs = math.inf
        df = d[fin]
        if df.numel():
            self.max_abs = max(self.max_abs, float(df.max()))
            self.diff_sq += float(torch.dot(df, df))
        yf = y[torch.isfinite(y)]
        self.ref_sq += float(torch.dot(yf, yf))

    def result(self) -> dict:
        diff = math.sqrt(self.diff_sq)
        ref = math.sqrt(self.ref_sq)
        rel = diff / ref if ref else (0.0 if diff == 0 else math.inf)
        return {"count": self.count, "mismatches": self.mismatches, "max_abs": self.max_abs,
                "rel_l2": rel, "equal": self.mismatches == 0}
