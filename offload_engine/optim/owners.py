"""Which rank runs Newton-Schulz on each matrix: chosen once, the same on every rank.

Longest-processing-time first: within each communication chunk, matrices are taken in
descending Newton-Schulz cost (ties by position) and each goes to the rank with the least
work in that chunk, then the least work overall, then the lowest rank. Balancing per
chunk keeps every rank busy while a chunk's exchange is in flight; the overall tie-break
evens out the total. No communication: every rank computes the same answer from shapes.
"""

from __future__ import annotations

from .muon_math import ns_flops


def assign_owners(chunks: list[list[tuple[int, int]]], world: int,
                  ns_steps: int = 5) -> list[list[int]]:
    """``chunks[c][j] = (rows, cols)`` of matrix j of chunk c; returns ``owners[c][j]``."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    total = [0] * world
    owners = []
    for shapes in chunks:
        in_chunk = [0] * world
        out = [0] * len(shapes)
        order = sorted(range(len(shapes)), key=lambda j: (-ns_flops(*shapes[j], ns_steps), j))
        for j in order:
            r = min(range(world), key=lambda r: (in_chunk[r], total[r], r))
            cost = ns_flops(*shapes[j], ns_steps)
            in_chunk[r] += cost
            total[r] += cost
            out[j] = r
        owners.append(out)
    return owners
