"""The store group: the zarr group a TieredStore keeps its arrays in, and its manifest.

The group's attributes hold the store's own entries (``format``, ``format_version``,
``arrays``: dtype, element count, home tier and bucket size of every NVMe array, and
``stripes``: the NVMe directories) next to entries the layers above add (the optimizer's
tensor table, world size and step: docs/format.md). The store's keys are written last and
cannot be overridden; the others are kept as they are across rewrites and reopenings.
"""

from __future__ import annotations

import os

from .group import create_group, read_group, write_group_attributes
from .manifest import STORE_FORMAT, STORE_VERSION
from .metadata import metadata_path
from ..errors import InputError

# the optimizer's tables share the group, so the store's version says where they are
STORE_FORMAT_VERSION = STORE_VERSION
STORE_KEYS = frozenset({"format", "format_version", "arrays", "stripes"})


def open_store_group(root: str) -> dict:
    """Create the store group at ``root`` if there is none; return the entries of its
    manifest that are not the store's own (kept from an earlier run).

    Raises ValueError when ``root`` holds a zarr group of another kind.
    """
    if not os.path.exists(metadata_path(root)):
        create_group(root, {"format": STORE_FORMAT, "format_version": STORE_FORMAT_VERSION,
                            "arrays": {}})
        return {}
    attrs = read_group(root)
    if attrs.get("format", STORE_FORMAT) != STORE_FORMAT:
        raise InputError(f"{root} holds a zarr group that is not an offload-engine store")
    return {k: v for k, v in attrs.items() if k not in STORE_KEYS}


def store_array_entry(dtype_name: str, numel: int, home: str, bucket_elems: int) -> dict:
    """One array's entry in the manifest's ``arrays`` (``dtype_name``: the zarr data type
    name; ``numel`` and ``bucket_elems`` in elements)."""
    return {"dtype": dtype_name, "numel": numel, "home": home, "bucket_elems": bucket_elems}


def store_group_attributes(arrays: dict[str, dict], stripes: list[str], extra: dict) -> dict:
    """The group's attributes: ``extra`` (entries of the layers above) first, then the
    store's keys, which win. ``arrays``: name -> ``store_array_entry(...)``; ``stripes``:
    the NVMe directories, first one the group's."""
    clash = STORE_KEYS & set(extra)
    if clash:
        raise InputError(f"manifest keys {sorted(clash)} belong to the store")
    return {**extra, "format": STORE_FORMAT, "format_version": STORE_FORMAT_VERSION,
            "arrays": arrays, "stripes": stripes}


def write_store_group(root: str, arrays: dict[str, dict], stripes: list[str], extra: dict) -> None:
    """Rewrite the store group's attributes (atomically: a reader sees the old or the new)."""
    write_group_attributes(root, store_group_attributes(arrays, stripes, extra))


__all__ = ["STORE_FORMAT", "STORE_FORMAT_VERSION", "STORE_KEYS", "open_store_group",
           "store_array_entry", "store_group_attributes", "write_store_group"]
