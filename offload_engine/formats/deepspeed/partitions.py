"""Where each parameter's elements lie in DeepSpeed's per-rank flat partitions (pure arithmetic).

Every function returns, per tensor, a list of ``Piece``: a run of the tensor's flattened
elements held contiguously by one source tensor (a rank's flat group or fragment). The
caller maps each source key to file bytes. Counts and offsets are in elements.

ZeRO-1/2 (``stage_1_and_2.py``): a param group is flattened in ``param_shapes`` order
(with ``parameter_alignment``, each parameter but the last followed by
``param_alignment_paddings[g][i]`` elements of padding), padded at the tail to a multiple
of 2*world_size, cut into world_size equal partitions, and each rank saves its partition
without the tail padding. So the concatenation over ranks is the flat group and a
parameter is ``flat[off : off + numel]``.

ZeRO-3 (``partition_parameters.py``): each parameter is partitioned on its own into
``P = ceil(numel / world_size)`` elements per rank, the tail padding on the last rank(s).
A rank's flat buffer is its sub-groups concatenated; parameter p sits at the same offset
``sum(P of earlier params)`` on every rank. Rank r holds elements ``[r*P, (r+1)*P)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Sequence
from ...errors import InputError


class PartitionError(InputError):
    """The partition sizes do not add up to the parameter shapes (wrong or mixed files)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements ``[start, start + count)`` of a tensor are elements
    ``[src_offset, src_offset + count)`` of source tensor ``src``."""

    start: int
    count: int
    src: Hashable
    src_offset: int


def split_concat(start: int, count: int, lengths: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """Cut the range ``[start, start + count)`` of a virtual concatenation of parts of
    ``lengths`` into per-part runs ``(part index, offset in part, offset in range, count)``.

    Raises PartitionError when the range runs past the end of the concatenation.
    """
    runs = []
    part_start = 0
    pos, end = start, start + count
    for i, n in enumerate(lengths):
        part_end = part_start + n
        if pos < part_end and pos < end:
            take = min(end, part_end) - pos
            runs.append((i, pos - part_start, pos - start, take))
            pos += take
        part_start = part_end
        if pos >= end:
            break
    if pos < end:
        raise PartitionError(f"elements [{start}, {end}) reach past the {part_start} elements available")
    return runs


def concat_pieces(start: int, count: int, parts: Sequence[tuple[Hashable, int]]) -> list[Piece]:
    """Pieces of ``count`` elements taken from offset ``start`` of the concatenation of
    ``parts`` = [(source key, length)]."""
    lengths = [n for _, n in parts]
    return [Piece(rel, n, parts[i][0], off) for i, off, rel, n in split_concat(start, count, lengths)]


def zero12_layout(group_params: Sequence[Sequence[tuple[str, int]]],
                  partition_numels: Sequence[Sequence[int]],
                  param_paddings: Sequence[Sequence[int]] | None = None) -> dict[str, list[Piece]]:
    """ZeRO-1/2 trainable parameters.

    Args:
        group_params: per param group, [(name, numel)] in ``param_shapes`` order.
        partition_numels: ``[rank][group]`` numel of ``single_partition_of_fp32_groups``.
        param_paddings: ``[group][param]`` elements of padding after each parameter
            (``param_alignment_paddings``, DeepSpeed >= 0.19 with ``parameter_alignment``);
            None: parameters are back to back.

    Source keys are ``(rank, group)``.
    """
    every_rank = range(len(partition_numels))
    return zero12_replica_layout([[(every_rank, params)] for params in group_params],
                                 partition_numels, param_paddings)


def zero12_replica_layout(replicas: Sequence[Sequence[tuple[Sequence[int], Sequence[tuple[str, int]]]]],
                          partition_numels: Sequence[Sequence[int]],
                          param_paddings: Sequence[Sequence[int]] | None = None) -> dict[str, list[Piece]]:
    """ZeRO-1/2 trainable parameters of a run whose param groups are partitioned over
    different sets of ranks (DeepSpeed MoE: an expert group over each expert data-parallel
    group, one copy of its flat layout per expert-parallel rank).

    Args:
        replicas: per param group, ``[(ranks in partition order, [(name, numel)])]``: one
            entry for a group partitioned over every rank, one per expert-parallel rank for
            an expert group (the same shapes, each under its own experts' names).
        partition_numels: ``[rank][group]`` numel of ``single_partition_of_fp32_groups``.
        param_paddings: as for ``zero12_layout`` (the same for every copy of a group).

    Source keys are ``(rank, group)``.
    """
    out: dict[str, list[Piece]] = {}
    for g, copies in enumerate(replicas):
        pads = param_paddings[g] if param_paddings is not None else None
        for ranks, params in copies:
            out.update(_zero12_group(g, params, [((r, g), partition_numels[r][g]) for r in ranks], pads))
    return out


def _zero12_group(g: int, params: Sequence[tuple[str, int]], parts: list[tuple[Hashable, int]],
                  pads: Sequence[int] | None) -> dict[str, list[Piece]]:
    """One param group's flat layout over the partitions ``parts`` = [(source key, numel)]
    (DeepSpeed aligns a group to 2 elements per partition)."""
    align = 2 * len(parts)
    avail = sum(n for _, n in parts)
    pads = pads if pads is not None else [0] * len(params)
    if len(pads) != len(params):
        raise PartitionError(f"param group {g}: {len(pads)} alignment paddings for {len(params)} parameters")
    out: dict[str, list[Piece]] = {}
    offset = 0
    for (name, numel), pad in zip(params, pads):
        if offset + numel > avail:
            raise PartitionError(f"param group {g}: {name} needs elements up to {offset + numel}, "
                                 f"but the {len(parts)} rank partitions hold {avail}")
        out[name] = concat_pieces(offset, numel, parts)
        offset += numel + pad
    # DeepSpeed pads each group to a multiple of 2*world_size; what remains may differ
    # from what was consumed only within that alignment (zero_to_fp32's own check).
    if math.ceil(offset / align) != math.ceil(avail / align):
        raise PartitionError(f"param group {g}: parameters consume {offset} elements but the rank "
                             f"partitions hold {avail} (not within the {align}-element alignment)")
    return out


def zero12_momentum_layout(layout: dict[str, list[Piece]]) -> tuple[dict[str, list[Piece]], dict]:
    """ZeRO-1/2 Muon momentum (DeepSpeed's ``MuonWithAuxAdam`` at stage 1 or 2), from the
    fp32 ``layout`` of ``zero12_layout``.

    Each rank keeps, per param group, the momentum of every parameter that overlaps its
    partition, whole (not only its partition's elements), back to back in the group's
    parameter order (``_muon_momentum_buffer`` in ``stage_1_and_2.py``): a parameter that
    straddles two partitions is kept by both ranks, identically. Each parameter is read
    from the lowest rank that keeps it.

    Returns ``({name: [Piece]}, {(rank, group): elements its momentum must hold})``;
    source keys are ``(rank, group)``.
    """
    used: dict = {}
    out: dict[str, list[Piece]] = {}
    for name, pieces in layout.items():  # group by group, each in parameter order
        keepers = sorted({p.src for p in pieces if p.count})
        numel = sum(p.count for p in pieces)
        out[name] = [Piece(0, numel, keepers[0], used.get(keepers[0], 0))] if keepers else []
        for key in keepers:
            used[key] = used.get(key, 0) + numel
    return out, used


def zero3_layout(params: Sequence[tuple[str, int]],
                 group_numels: Sequence[Sequence[int]]) -> dict[str, list[Piece]]:
    """ZeRO-3 trainable parameters, every sub-group partitioned over all ranks.

    Args:
        params: [(name, numel)] in merged ``param_shapes`` order (all sub-groups).
        group_numels: ``[rank][sub-group]`` numel of ``fp32_flat_groups``.

    Source keys are ``(rank, sub-group)``.
    """
    every = tuple(range(len(group_numels)))
    partitions = [[(every, r)] * len(group_numels[r]) for r in every]
    return {name: copies[every] for name, copies in
            zero3_replica_layout(params, group_numels, partitions).items()}


def zero3_replica_layout(params: Sequence[tuple[str, int]], group_numels: Sequence[Sequence[int]],
                         partitions: Sequence[Sequence[tuple[tuple[int, ...], int]]]
                         ) -> dict[str, dict[tuple[int, ...], list[Piece]]]:
    """ZeRO-3 trainable parameters whose sub-groups may be partitioned over a subset of
    the ranks (DeepSpeed AutoEP: an expert sub-group over an expert data-parallel group,
    so each group of ranks holds its own copy: its experts).

    A parameter of sub-group g is partitioned on its own over that sub-group's ``P``
    ranks, ``ceil(numel / P)`` elements each; a rank's flat buffer is its sub-groups
    concatenated, so a parameter sits at the same offset on every rank. Sub-groups are
    filled in parameter order (rank 0's sizes say where one ends).

    Args:
        params: [(name, numel)] in merged ``param_shapes`` order (all sub-groups).
        group_numels: ``[rank][sub-group]`` numel of ``fp32_flat_groups``.
        partitions: ``[rank][sub-group]`` (the ranks partitioning it, in partition order;
            this rank's index among them).

    Returns ``{name: {ranks: [Piece]}}``, one entry per group of ranks holding a copy;
    source keys are ``(rank, sub-group)``.
    """
    world_size = len(group_numels)
    parts_by_rank = [[((r, g), n) for g, n in enumerate(group_numels[r])] for r in range(world_size)]
    out: dict[str, dict[tuple[int, ...], list[Piece]]] = {}
    offset = 0  # same on every rank
    g, g_start, last = 0, 0, len(group_numels[0]) - 1 if group_numels else 0
    for name, numel in params:
        while g < last and offset - g_start >= group_numels[0][g]:
            g_start += group_numels[0][g]
            g += 1
        sizes = {len(partitions[r][g][0]) for r in range(world_size)}
        if len(sizes) != 1:
            raise PartitionError(f"sub-group {g} is partitioned over {sorted(sizes)} ranks on "
                                 f"different ranks ({name})")
        per_rank = math.ceil(numel / sizes.pop())
        copies: dict[tuple[int, ...], list[Piece]] = {}
        for r in range(world_size):
            ranks, index = partitions[r][g]
            lo, hi = index * per_rank, min(numel, (index + 1) * per_rank)
            pieces = copies.setdefault(tuple(ranks), [])
            if lo >= hi:
                continue  # this rank holds only padding of this parameter
            try:
                runs = concat_pieces(offset, hi - lo, parts_by_rank[r])
            except PartitionError:
                raise PartitionError(f"rank {r}: {name} needs flat elements up to {offset + hi - lo}, but "
                                     f"its fp32 groups hold {sum(group_numels[r])}") from None
            pieces += [Piece(lo + p.start, p.count, p.src, p.src_offset) for p in runs]
        for ranks, pieces in copies.items():
            if sum(p.count for p in pieces) != numel:
                raise PartitionError(f"{name}: ranks {list(ranks)} hold {sum(p.count for p in pieces)} "
                                     f"of its {numel} elements (partition groups do not match)")
        out[name] = copies
        offset += per_rank
    for r in range(world_size):
        if offset != sum(group_numels[r]):
            raise PartitionError(f"rank {r}: parameters consume {offset} elements of each rank's flat "
                                 f"buffer but its fp32 groups hold {sum(group_numels[r])}")
    return out


def fragments_layout(numel: int, fragment_numels: Sequence[tuple[Hashable, int]]) -> list[Piece]:
    """A tensor that is the first ``numel`` elements of its fragments concatenated (ZeRO-3
    frozen parameters: each rank's padded ``ds_tensor``)."""
    return concat_pieces(0, numel, fragment_numels)
