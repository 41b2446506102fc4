"""Which rank runs Newton-Schulz on each matrix: chosen once, the same on every rank.

Longest-processing-time first: within each communication bundle, matrices are taken in
descending Newton-Schulz cost (ties by position) and each goes to the rank with the least
work in that bundle, then the least work overall, then the lowest rank. Balancing per
bundle keeps every rank busy while a bundle's exchange is in flight; the overall tie-break
evens out the total. No communication: every rank computes the same answer from shapes.

A matrix is a 2-D parameter or one expert of a stack (``matrices.py``). An expert goes
only to a rank that holds part of it: the one rank holding it whole under expert
parallelism (no exchange), one of the ranks FSDP split it over (the exchange stays inside
that expert-data-parallel group). These constrained matrices are placed first, so the
others fill up around them, and no rank does more than its share plus one matrix when the
experts spread evenly.
"""

from __future__ import annotations

from .muon_defaults import DEFAULT_NS_STEPS
from ..errors import InputError


def ns_flops(rows: int, cols: int, ns_steps: int = DEFAULT_NS_STEPS) -> int:
    """Multiply-add work of Newton-Schulz on a rows x cols matrix (m = min, n = max dim)."""
    m, n = sorted((rows, cols))
    return ns_steps * (4 * m * m * n + 2 * m ** 3)


def shape_ns_flops(shape, ns_steps: int = DEFAULT_NS_STEPS) -> int:
    """Newton-Schulz work of a Muon parameter of ``shape``: a matrix (rows, cols), or a stack
    of expert matrices (experts, rows, cols), one Newton-Schulz per expert."""
    if len(shape) == 3:
        return shape[0] * ns_flops(shape[1], shape[2], ns_steps)
    return ns_flops(shape[0], shape[1], ns_steps)


def assign_owners(bundles: list[list[tuple[int, ...]]], world: int,
                  ns_steps: int = DEFAULT_NS_STEPS,
                  candidates: list[list[list[int] | None]] | None = None) -> list[list[int]]:
    """``bundles[c][j]`` = the shape of matrix j of bundle c ((rows, cols); a 3-D stack's
    shape counts as its experts' work on one owner); returns ``owners[c][j]``.

    ``candidates[c][j]``: the ranks matrix j may go to (an expert: the ranks holding part of
    it, so that it never leaves them; one rank when that rank holds it whole), or None: any
    rank. The most constrained matrices are placed first, then by descending cost."""
    if world < 1:
        raise InputError(f"world size must be >= 1, got {world}")
    total = [0] * world
    owners = []
    for c, shapes in enumerate(bundles):
        in_bundle = [0] * world
        out = [0] * len(shapes)
        allowed = candidates[c] if candidates is not None else [None] * len(shapes)
        ranks = [list(range(world)) if a is None else list(a) for a in allowed]
        order = sorted(range(len(shapes)),
                       key=lambda j: (len(ranks[j]), -shape_ns_flops(shapes[j], ns_steps), j))
        for j in order:
            r = min(ranks[j], key=lambda r: (in_bundle[r], total[r], r))
            cost = shape_ns_flops(shapes[j], ns_steps)
            in_bundle[r] += cost
            total[r] += cost
            out[j] = r
        owners.append(out)
    return owners
