"""zarr v3 groups: a directory with ``zarr.json`` {"zarr_format": 3, "node_type": "group",
"attributes": {...}}; its children are sub-directories that are nodes themselves.

A store or checkpoint generation is a group; the layers above keep their manifest in its
attributes, rewritten atomically so a reader sees the old or the new manifest, never a mix.
Group metadata is written as compact JSON (no indentation): a manifest of 50,000 tensors is
half the bytes to read and parse that way.
"""

from __future__ import annotations

import os

from ..io import syscalls
from ..io.errors import FileIOError
from .metadata import (MetadataError, NodeNotFoundError, compact_json, metadata_path, parse_node,
                       read_node, read_node_bytes, write_text_atomic)
from .metadata_crc import SEAL_KEY, check_crc32c, check_seal, seal, unsealed_attributes
from ..errors import InputError, PathExistsError


def group_doc(attributes: dict) -> dict:
    """A group's ``zarr.json`` document with ``attributes``."""
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes}


def _group_text(doc: dict, path, sealed: bool = False) -> str:
    """``doc`` as compact JSON, serialised once (it doubles as the check that the
    attributes are strict JSON); ``sealed`` ends it with the seal over its bytes
    (``metadata_crc.py``: a committed checkpoint's manifest). Errors name the group."""
    if not isinstance(doc.get("attributes"), dict):
        raise InputError(f"group {os.fspath(path)}: attributes must be a dict, got "
                         f"{type(doc.get('attributes')).__name__}")
    if sealed:
        doc = {**{k: v for k, v in doc.items() if k != "attributes"},
               "attributes": unsealed_attributes(doc["attributes"])}
    try:
        text = compact_json(doc) + "\n"
    except (TypeError, ValueError) as e:
        raise InputError(f"group {os.fspath(path)}: attributes are not JSON-serialisable: "
                         f"{e}") from None
    return seal(text) if sealed else text


def create_group(path: str | os.PathLike, attributes: dict | None = None, *,
                 exist_ok: bool = False, sealed: bool = False) -> None:
    """Create a group at ``path`` (parent directories too) with ``attributes``; ``sealed``
    ends its zarr.json with the seal over its bytes (a committed checkpoint's manifest).

    An existing group is an error unless ``exist_ok``; then it is kept, and its attributes
    are replaced when ``attributes`` is given. An existing array is always an error.
    """
    path = os.fspath(path)
    if os.path.exists(metadata_path(path)):
        doc = read_node(path, "group")
        if doc["node_type"] != "group":
            raise PathExistsError(f"cannot create group at {path}: an array is there")
        if not exist_ok:
            raise PathExistsError(f"cannot create group at {path}: a group is already there")
        if attributes is not None:
            write_group_attributes(path, attributes, sealed=sealed)
        return
    text = _group_text(group_doc(attributes or {}), path, sealed)  # checked before any mkdir
    try:
        syscalls.makedirs(path, exist_ok=True)
    except OSError as e:
        raise FileIOError(e.errno, "mkdir", path) from e
    write_text_atomic(metadata_path(path), text)


def read_group(path: str | os.PathLike, crc32c: int | None = None, *,
               verify_seal: bool = False) -> dict:
    """The attributes of the group at ``path``.

    ``crc32c``: the checksum a checkpoint manifest records for this zarr.json (a shard
    table): its bytes are checked against it before they are parsed. ``verify_seal``: when
    the attributes hold a seal (a checkpoint's manifest), check it against the file's bytes.
    Raises NodeNotFoundError when there is no node, ChecksumError (naming zarr.json) when
    its bytes are not the recorded ones, MetadataError (naming it) when the metadata is
    corrupt or describes an array.
    """
    file, raw = read_node_bytes(path, "group")
    if crc32c is not None:
        check_crc32c(raw, crc32c, file)
    doc = parse_node(raw, file)
    if doc["node_type"] != "group":
        raise MetadataError(f"{file} describes an array, not a group")
    attributes = doc.get("attributes", {})
    if verify_seal and SEAL_KEY in attributes:
        check_seal(raw, file)
    return dict(attributes)


def write_group_attributes(path: str | os.PathLike, attributes: dict, *,
                           sealed: bool = False) -> None:
    """Replace the group's attributes, atomically (temp file, fsync, rename, fsync dir);
    ``sealed`` as for ``create_group``.

    Other fields of zarr.json are kept as they are.
    """
    doc = _read_group_doc(path)
    doc["attributes"] = attributes
    write_text_atomic(metadata_path(path), _group_text(doc, path, sealed))


def list_children(path: str | os.PathLike) -> dict[str, str]:
    """Direct children of the group: {name: "array" | "group"}, sorted by name.

    Sub-directories without zarr.json are not nodes and are skipped; a child whose
    zarr.json is corrupt raises MetadataError naming it.
    """
    _read_group_doc(path)
    children = {}
    with os.scandir(os.fspath(path)) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            if entry.is_dir() and os.path.exists(metadata_path(entry.path)):
                children[entry.name] = read_node(entry.path)["node_type"]
    return children


def list_arrays(path: str | os.PathLike) -> list[str]:
    """Names of the arrays directly under the group, sorted."""
    return [name for name, kind in list_children(path).items() if kind == "array"]


def list_groups(path: str | os.PathLike) -> list[str]:
    """Names of the groups directly under the group, sorted."""
    return [name for name, kind in list_children(path).items() if kind == "group"]


def _read_group_doc(path) -> dict:
    doc = read_node(path, "group")
    if doc["node_type"] != "group":
        raise MetadataError(f"{metadata_path(path)} describes an array, not a group")
    return doc


__all__ = ["NodeNotFoundError", "create_group", "list_arrays", "list_children", "list_groups",
           "read_group", "write_group_attributes"]
