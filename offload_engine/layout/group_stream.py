"""A group's zarr.json written as it is produced: a table of 100,000 entries never held whole.

``create_group(path, attributes)`` serialises the whole document at once: the attributes
as Python objects, then the text, then its UTF-8 bytes. An import of a mixture-of-experts
checkpoint (100,000 tensors) held its shard tables and its tensor table that way, several
copies each. Here a member of the attributes may be ``Streamed``: a JSON object or array
given as an iterator, each item built just before it is written and dropped after. The
bytes are exactly those ``create_group`` writes for the same attributes (compact strict
JSON; ``sealed``: the manifest's seal last, ``metadata_crc.py``, its CRC-32C taken as the
bytes go out), written to a temporary file, fsynced and renamed into place as
``write_text_atomic`` does, so a reader sees the old file or the new one.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Iterator

from ..errors import InputError
from ..io import syscalls
from ..io.errors import FileIOError
from .checksums import crc32c_extend
from .group import group_doc
from .metadata import compact_json, metadata_path, write_bytes_atomic
from .metadata_crc import SEAL_KEY

FLUSH_BYTES = 1 << 20  # text gathered before each write (bytes)
# compact_json's encoder, made once: json.dumps with options builds one per call, which
# was most of the time of a table of 100,000 small entries
_member = json.JSONEncoder(allow_nan=False, separators=(",", ":")).encode


class Streamed:
    """A JSON object (``pairs``: ``(str key, value)``) or array (``items``) whose members
    are produced while the file is written; each member is plain JSON data."""

    __slots__ = ("members", "is_object")

    def __init__(self, members: Iterable, is_object: bool):
        self.members = members
        self.is_object = is_object

    @classmethod
    def object(cls, pairs: Iterable[tuple[str, object]]) -> "Streamed":
        return cls(pairs, True)

    @classmethod
    def array(cls, items: Iterable) -> "Streamed":
        return cls(items, False)


def _holds_stream(value) -> bool:
    if isinstance(value, Streamed):
        return True
    if isinstance(value, dict):
        return any(_holds_stream(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_stream(v) for v in value)
    return False


def _key(key) -> str:
    if not isinstance(key, str):
        raise InputError(f"a key beside streamed members must be a string, not {key!r}")
    return _member(key) + ":"


def _pieces(value) -> Iterator[str]:
    """The compact JSON text of ``value`` in pieces (``compact_json`` of the same data
    with every ``Streamed`` made a dict or list: the same characters)."""
    if isinstance(value, Streamed):
        yield "{" if value.is_object else "["
        sep = ""
        for member in value.members:
            if value.is_object:
                key, member = member
                yield sep + _key(key) + _member(member)
            else:
                yield sep + _member(member)
            sep = ","
        yield "}" if value.is_object else "]"
    elif isinstance(value, dict) and _holds_stream(value):
        yield "{"
        sep = ""
        for key, member in value.items():
            yield sep + _key(key)
            yield from _pieces(member)
            sep = ","
        yield "}"
    elif isinstance(value, (list, tuple)) and _holds_stream(value):
        yield "["
        sep = ""
        for member in value:
            yield sep
            yield from _pieces(member)
            sep = ","
        yield "]"
    else:
        yield compact_json(value)


def _document(attributes: dict, sealed: bool) -> Iterator[str]:
    """The group document's text in pieces; ``sealed``: up to and including the comma
    before the seal's key (the bytes the seal covers)."""
    empty = compact_json(group_doc({}))       # {...,"attributes":{}}: attributes come last
    yield empty[:-2]
    sep = ""
    for key, value in attributes.items():
        if sealed and key == SEAL_KEY:
            continue
        yield sep + _key(key)
        yield from _pieces(value)
        sep = ","
    yield sep if sealed else "}}\n"


def write_group_streamed(path: str | os.PathLike, attributes: dict, *,
                         sealed: bool = False) -> int:
    """Create or replace the group at ``path`` with ``attributes`` (parent directories
    too), the same bytes as ``create_group(path, attributes, sealed=sealed)`` would write
    for the attributes with each ``Streamed`` made whole; returns the bytes written.
    InputError (naming the group) for attributes strict JSON cannot hold, FileIOError
    naming zarr.json for a failed write; either way ``path`` is left as it was."""
    path = os.fspath(path)
    try:
        syscalls.makedirs(path, exist_ok=True)
    except OSError as e:
        raise FileIOError(e.errno, "mkdir", path) from e
    return write_bytes_atomic(metadata_path(path),
                              _encoded(_document(attributes, sealed), sealed, path))


def _encoded(pieces: Iterator[str], sealed: bool, group: str) -> Iterator[bytes]:
    """The text ``pieces`` as UTF-8 in chunks of about ``FLUSH_BYTES``, then, ``sealed``,
    the seal over every byte before it."""
    gathered: list[str] = []
    held = crc = 0
    try:
        for piece in pieces:
            gathered.append(piece)
            held += len(piece)
            if held >= FLUSH_BYTES:
                data = "".join(gathered).encode("utf-8")
                crc = crc32c_extend(crc, data)
                yield data
                gathered, held = [], 0
    except (TypeError, ValueError) as e:  # json: NaN, or an object JSON has no form for
        raise InputError(f"group {group}: attributes are not JSON-serialisable: {e}") from None
    data = "".join(gathered).encode("utf-8")
    yield data
    if sealed:
        yield f'"{SEAL_KEY}":"{crc32c_extend(crc, data):08x}"}}}}\n'.encode()


__all__ = ["Streamed", "write_group_streamed"]
