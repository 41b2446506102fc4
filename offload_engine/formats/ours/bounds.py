"""What a manifest declares, checked against what it holds before anything is sized by it.

A manifest's numbers size what readers allocate and iterate: ``world_size`` the list of
ranks whose shard tables are read, a tensor's ``shape`` the buffers that receive it. A
forged ``world_size`` of 10**9 made plain ``inspect`` build a list of 10**9 ranks; a forged
shape of 10**12 made ``export`` allocate 4 TB. So, before either is used:

- a group holding every rank (a checkpoint, or a store of all ranks) has arrays of every
  rank ``0 .. world_size-1`` (``rank{r}/...`` in ``arrays``): the world size can be no
  larger than the number of ranks its arrays belong to, which the file's size bounds;
- a live store records its ``rank``: ``0 <= rank < world_size``, and nothing is sized by
  the world size there (``RowSplit`` computes a rank's rows without listing the others);
- the elements each rank holds of every tensor state, by the tensor table, fit in that
  rank's arrays of the state's dtype (by ``arrays``' ``numel``, which each array's
  zarr.json and chunk files are checked against when it is opened).
"""

from __future__ import annotations

from ..errors import CheckpointError


def held_ranks_checked(attrs: dict, world: int, arrays: dict, where: str,
                       empty_ranks_ok: bool = False) -> list[int]:
    """The ranks whose shard tables the group holds (``layout.manifest.held_ranks``), each
    checked to exist in ``arrays`` ({name: ArrayEntry}) before the list is built.
    ``empty_ranks_ok``: a version 4 checkpoint, whose ranks may hold no array (an HSDP
    replica saves nothing) and whose world size its ``metadata_checksums`` bound instead
    (one checksum per rank's shard table, checked before)."""
    if "rank" in attrs:
        rank = attrs["rank"]
        if type(rank) is not int or not 0 <= rank < world:
            raise CheckpointError(f"{where}: 'rank' must be an integer in [0, {world}), got "
                                  f"{rank!r}")
        return [rank]
    if empty_ranks_ok:
        return list(range(world))
    have = {a.rank for a in arrays.values() if a.rank is not None and a.rank < world}
    if world > max(1, len(have)):
        missing = [r for r in range(len(have) + 3) if r not in have][:3]
        raise CheckpointError(f"{where}: world_size is {world} but 'arrays' has arrays of only "
                              f"{len(have)} rank(s), none of rank(s) {missing} (a missing rank, "
                              f"or a wrong world_size)")
    return list(range(world))


class RowSplit:
    """The rows each of ``world`` ranks holds under FSDP2 ``Shard(0)``
    (``layout.manifest.fsdp_rows``) as a sequence computed on demand: ``split[r]`` and
    ``split.start(r)`` in O(1), so a world size is never a length to allocate."""

    __slots__ = ("rows", "world", "per")

    def __init__(self, rows: int, world: int):
        self.rows, self.world = rows, world
        self.per = -(-rows // world) if rows else 0

    def start(self, rank: int) -> int:
        """First row of rank ``rank``'s block."""
        return min(self.rows, rank * self.per)

    def __getitem__(self, rank: int) -> int:
        if not 0 <= rank < self.world:
            raise IndexError(rank)
        return min(self.rows, (rank + 1) * self.per) - self.start(rank)

    def __len__(self) -> int:
        return self.world

    def __iter__(self):
        return (self[r] for r in range(self.world))


def check_capacity(per_split: dict, ranks: list[int], tensors: list, arrays: dict,
                   where: str) -> None:
    """The elements the tensor table puts on each of ``ranks`` fit in that rank's arrays
    of each state's dtype (sum of ``numel`` in ``arrays``; an array of no rank counts for
    every rank). ``per_split``: {(rows per rank, dtype): elements per row}, summed over
    the tensor states sharing both (a few keys for 50,000 tensors: FSDP2 splits are
    shared, so this costs little next to parsing). ``tensors`` (TensorMeta) only name the
    largest contributor in the error."""
    have, anyone = {}, {}
    for a in arrays.values():
        if a.rank is None:
            anyone[a.dtype] = anyone.get(a.dtype, 0) + a.numel
        else:
            have[(a.rank, a.dtype)] = have.get((a.rank, a.dtype), 0) + a.numel
    need = {}
    for (counts, dtype), row_numel in per_split.items():
        for r in ranks:
            need[(r, dtype)] = need.get((r, dtype), 0) + counts[r] * row_numel
    for (rank, dtype), elements in need.items():
        room = have.get((rank, dtype), 0) + anyone.get(dtype, 0)
        if elements > room:
            tensor, state, most = max(((t.name, s, sm.bytes_by_rank.get(rank, 0) // sm.dtype.itemsize)
                                       for t in tensors for s, sm in t.states.items()
                                       if sm.dtype == dtype), key=lambda x: x[2])
            raise CheckpointError(
                f"{where}: the tensor table puts {elements} {dtype} elements on rank {rank} "
                f"(the most, {most}: tensor {tensor!r}, state {state!r}), but rank {rank}'s "
                f"{dtype} arrays hold {room}: a shape, dtype or row split that does not "
                f"match the arrays")
