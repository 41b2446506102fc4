"""zarr v3 on-disk format: flat 1-D arrays with engine-owned chunk I/O, groups, the manifest,
striping, and zarr-python's bfloat16.

Importing this package teaches zarr-python the ``"bfloat16"`` data type, so
``zarr.open_array`` reads (and writes) the engine's bfloat16 arrays; it does so when zarr
is imported, not before (``zarr_registration``): the engine's own I/O needs neither zarr
nor ml_dtypes. docs/format.md describes the format for readers in other languages.
"""

from .flat_array import (DEFAULT_CHUNK_BYTES, ChunkSizeError, FlatArray, TruncatedChunkError)
from .group import (create_group, list_arrays, list_children, list_groups, read_group,
                    write_group_attributes)
from .metadata import ForeignArrayError, MetadataError, NodeNotFoundError
from .zarr_registration import register_when_zarr_is_imported

register_when_zarr_is_imported()

__all__ = [
    "BFloat16", "ChunkSizeError", "DEFAULT_CHUNK_BYTES", "FlatArray", "ForeignArrayError",
    "MetadataError", "NodeNotFoundError", "TruncatedChunkError", "create_group", "list_arrays",
    "list_children", "list_groups", "read_group", "register_bfloat16",
    "write_group_attributes",
]


def __getattr__(name: str):
    # zarr-python's data type class: importing it imports zarr and ml_dtypes (seconds)
    if name in ("BFloat16", "register_bfloat16"):
        from . import zarr_bfloat16
        return getattr(zarr_bfloat16, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
