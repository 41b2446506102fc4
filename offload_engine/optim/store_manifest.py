"""What ZeroMuon records in its store (docs/format.md, "Manifest"), so offline tools can
show a live store per parameter: the tensor table (global shape, dtype, optimizer kind,
state dtypes) in the store's group attributes, and beside it (``shards``) this rank's shard
table (where its rows, or its box, of every state sit in the flat arrays). The planner sizes the same
tables with ``manifest_tables`` (pure: no torch)."""

from __future__ import annotations

from typing import Callable

from .. import dtypes
from ..layout.manifest import box_shard_entry, shard_entry, tensor_entry


def store_manifest(opt) -> tuple[dict, dict]:
    """``({"world_size", "rank", "tensors"}, shard table)`` for this rank's store.

    A replicated (non-DTensor) parameter is kept whole by every rank's store, so its
    ``rows_per_rank`` is all rows on every rank. A parameter held as boxes (a 2-D mesh,
    tensor parallel, a replicated DTensor) records every rank's box, replicas included."""
    return manifest_tables(opt.infos, opt.layout, opt.rank, opt.world, opt.array_name,
                           lambda i: i.rows_per_rank if i.distributed else [i.rows] * opt.world)


def manifest_tables(infos, layout, rank: int, world: int, array_name: Callable[[str], str],
                    rows_of: Callable) -> tuple[dict, dict]:
    """The tensor table entries and rank ``rank``'s shard table for parameters ``infos``
    laid out by ``layout``; ``rows_of(info)`` gives the rows each of the ``world`` ranks
    holds (a row split), ``array_name`` the store name of a layout array. A parameter held
    as boxes records them (``info.boxes``) instead of rows."""
    tensors, shards = {}, {}
    for info in infos:
        bundle = layout.bundle_of(info.index)
        offset = bundle.offsets[info.index]
        name = info.name or f"param.{info.index}"
        state_dtypes = {k.kind.state_key: k.dtype.name for k in bundle.keys}
        where = {k.kind.state_key: (array_name(k.name), bundle.starts[k.name] + offset)
                 for k in bundle.keys}
        dtype = dtypes.dtype(info.dtype).name
        if info.boxes is not None:
            tensors[name] = tensor_entry(info.shape, dtype, info.kind, state_dtypes, [], world,
                                         [(b.lo, b.shape) if b.numel else None for b in info.boxes])
            box = info.boxes[rank]
            if box.numel:
                shards[name] = box_shard_entry(box.lo, box.shape, where)
            continue
        rows = rows_of(info)
        tensors[name] = tensor_entry(info.shape, dtype, info.kind, state_dtypes, rows, world)
        row_start = sum(rows[:rank]) if info.distributed else 0
        shards[name] = shard_entry(row_start, rows[rank], bundle.sizes[info.index], where)
    return {"world_size": world, "rank": rank, "tensors": tensors}, shards
