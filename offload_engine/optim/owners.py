"""Which rank runs Newton-Schulz on each matrix: chosen once, the same on every rank.

Longest-processing-time first: within each communication bundle, matrices are taken in
descending Newton-Schulz cost (ties by position) and each goes to the rank with the least
work in that bundle, then the least work overall, then the lowest rank. Balancing per
bundle keeps every rank busy while a bundle's exchange is in flight; the overall tie-break
evens out the total. No communication: every rank computes the same answer from shapes.
"""

from __future__ import annotations

from .muon_defaults import DEFAULT_NS_STEPS
from ..errors import InputError


def ns_flops(rows: int, cols: int, ns_steps: int = DEFAULT_NS_STEPS) -> int:
    """Multiply-add work of Newton-Schulz on a rows x cols matrix (m = min, n = max dim)."""
    m, n = sorted((rows, cols))
    return ns_steps * (4 * m * m * n + 2 * m ** 3)


def assign_owners(bundles: list[list[tuple[int, int]]], world: int,
                  ns_steps: int = DEFAULT_NS_STEPS) -> list[list[int]]:
    """``bundles[c][j] = (rows, cols)`` of matrix j of bundle c; returns ``owners[c][j]``."""
    if world < 1:
        raise InputError(f"world size must be >= 1, got {world}")
    total = [0] * world
    owners = []
    for shapes in bundles:
        in_bundle = [0] * world
        out = [0] * len(shapes)
        order = sorted(range(len(shapes)), key=lambda j: (-ns_flops(*shapes[j], ns_steps), j))
        for j in order:
            r = min(range(world), key=lambda r: (in_bundle[r], total[r], r))
            cost = ns_flops(*shapes[j], ns_steps)
            in_bundle[r] += cost
            total[r] += cost
            out[j] = r
        owners.append(out)
    return owners
