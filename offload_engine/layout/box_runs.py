"""Boxes of a tensor as runs of its flattened elements (docs/format.md, "Manifest").

A shard table entry may record a **box**: index ranges ``[start[d], start[d] + shape[d])``
in every dimension of a tensor (tensor parallel's rectangles, a 2-D mesh's blocks). The
box's elements are stored row-major, as the rank's local tensor holds them. In the
flattened tensor they are ``prod(shape[:k])`` runs of equal length, where ``k`` is the
last dimension the box does not span whole: a box of whole rows is one run, a block of
columns one run per row.

Pure: no torch, no numpy; readers (formats/ours) and the checkpoint loader both use it.
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence


def strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape``, in elements."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def first_element(shape: Sequence[int], start: Sequence[int]) -> int:
    """Flat index of the box's first element (``start``) in a tensor of ``shape``."""
    return sum(s * st for s, st in zip(start, strides(shape)))


def box_runs(shape: Sequence[int], start: Sequence[int], extent: Sequence[int], lo: int = 0,
             hi: int | None = None) -> Iterator[tuple[int, int, int]]:
    """The runs of the box (``start``, ``extent``) of a tensor of ``shape`` that fall in
    flat elements ``[lo, hi)`` of the tensor, in order: ``(tensor element, box element,
    count)`` (box elements count row-major through the box, as its holder stores them)."""
    total = math.prod(shape)
    hi = total if hi is None else min(hi, total)
    lo = max(lo, 0)
    if lo >= hi or math.prod(extent) == 0:
        return
    k = len(shape) - 1
    while k >= 0 and start[k] == 0 and extent[k] == shape[k]:
        k -= 1
    if k < 0:                               # the whole tensor: one run
        yield lo, lo, hi - lo
        return
    st = strides(shape)
    run = extent[k] * st[k]
    nruns = math.prod(extent[:k])
    base = start[k] * st[k]

    def dest(j: int) -> int:                # tensor element where run j starts
        pos = base
        for d in range(k - 1, -1, -1):
            j, m = divmod(j, extent[d])
            pos += (start[d] + m) * st[d]
        return pos

    a, b = 0, nruns                         # the first run that ends after lo
    while a < b:
        mid = (a + b) // 2
        if dest(mid) + run <= lo:
            a = mid + 1
        else:
            b = mid
    for j in range(a, nruns):
        d0 = dest(j)
        if d0 >= hi:
            break
        s, e = max(lo, d0), min(hi, d0 + run)
        yield s, j * run + s - d0, e - s


def overlap(a: tuple[Sequence[int], Sequence[int]], b: tuple[Sequence[int], Sequence[int]]) -> bool:
    """Whether boxes ``a`` and ``b`` (each ``(start, extent)``, non-empty) share an element."""
    return all(max(sa, sb) < min(sa + ea, sb + eb)
               for sa, ea, sb, eb in zip(a[0], a[1], b[0], b[1]))
