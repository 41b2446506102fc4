"""What ZeroMuon records in its store's manifest (docs/format.md, "Manifest"), so offline
tools can show a live store per parameter: global shape, dtype, optimizer kind, and where
this rank's rows of every state sit in the flat arrays."""

from __future__ import annotations

from ..layout.dtypes import torch_to_zarr
from .state_io import state_key


def store_manifest(opt) -> dict:
    """``{"world_size", "rank", "tensors"}`` for this rank's store."""
    tensors = {}
    for info in opt.infos:
        chunk = opt.layout.chunks[opt.layout.param_chunk[info.index]]
        r = opt.rank if info.distributed else 0
        offset = chunk.offsets[info.index]
        tensors[info.name or f"param.{info.index}"] = {
            "shape": list(info.shape), "dtype": torch_to_zarr(info.dtype), "optimizer": info.kind,
            "shards": [{
                "rank": opt.rank, "row_start": info.row_offset(r), "rows": info.rows_per_rank[r],
                "numel": chunk.sizes[info.index],
                "states": {state_key(name): {"array": opt.array_name(name),
                                             "offset": chunk.starts[name] + offset}
                           for name in chunk.arrays},
            }],
        }
    return {"world_size": opt.world, "rank": opt.rank, "tensors": tensors}
