"""zarr v3 on-disk format: flat 1-D arrays with engine-owned chunk I/O, groups, bfloat16.

Importing this package registers the ``"bfloat16"`` data type with zarr-python, so
``zarr.open_array`` reads (and writes) the engine's bfloat16 arrays. docs/format.md
describes the format for readers in other languages.
"""

from .dtypes import (BFloat16, ElementType, register_bfloat16, torch_to_zarr, zarr_to_torch)
from .flat_array import (DEFAULT_CHUNK_BYTES, ChunkSizeError, FlatArray, TruncatedChunkError)
from .group import (create_group, list_arrays, list_children, list_groups, read_group,
                    write_group_attributes)
from .metadata import ForeignArrayError, MetadataError, NodeNotFoundError

register_bfloat16()

__all__ = [
    "BFloat16", "ChunkSizeError", "DEFAULT_CHUNK_BYTES", "ElementType", "FlatArray",
    "ForeignArrayError", "MetadataError", "NodeNotFoundError", "TruncatedChunkError",
    "create_group", "list_arrays", "list_children", "list_groups", "read_group",
    "register_bfloat16", "torch_to_zarr", "write_group_attributes", "zarr_to_torch",
]
