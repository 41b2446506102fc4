"""The members of one large attribute of a group's zarr.json, parsed one at a time.

A shard table of 100,000 tensors is a 25 MB zarr.json whose ``json.loads`` builds about
1.3 KB of Python objects per tensor (five small dicts, their strings and integers) before
the first one is looked at. ``iter_attribute_members`` walks the same bytes with the
standard decoder's ``raw_decode`` and yields the members of ``attributes[key]`` one by one,
so a reader that turns each into a compact record keeps one member's objects alive, not
the table's. The other fields of the document are parsed and checked as ``parse_node``
checks them. Stricter than ``json.loads`` in one way: a key repeated in the document, its
attributes or the walked object is an error (the standard parser would keep the last
silently).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

from .metadata import MetadataError, check_node_fields, read_node_bytes
from .metadata_crc import check_crc32c

_SPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


class _Cursor:
    """A position in the text of ``file``; errors name the file and the offset."""

    def __init__(self, text: str, file: str):
        self.text, self.file, self.pos = text, file, 0

    def fail(self, what: str) -> MetadataError:
        return MetadataError(f"{self.file} is not valid JSON: {what} (character {self.pos})")

    def skip(self) -> str:
        """The next non-space character ('' at the end), not consumed."""
        self.pos = _SPACE.match(self.text, self.pos).end()
        return self.text[self.pos:self.pos + 1]

    def expect(self, char: str) -> None:
        if self.skip() != char:
            raise self.fail(f"expected {char!r}")
        self.pos += 1

    def value(self):
        self.skip()
        try:
            v, self.pos = _DECODER.raw_decode(self.text, self.pos)
        except json.JSONDecodeError as e:
            raise MetadataError(f"{self.file} is not valid JSON: {e}") from None
        except RecursionError:
            raise self.fail("nested too deeply") from None
        return v

    def members(self, where: str) -> Iterator[str]:
        """The keys of the object that starts here, each left for the caller to read its
        value; a repeated key is an error."""
        self.expect("{")
        seen: set[str] = set()
        if self.skip() == "}":
            self.pos += 1
            return
        while True:
            if self.skip() != '"':
                raise self.fail(f"expected a key in {where}")
            key = self.value()
            if key in seen:
                raise MetadataError(f"{self.file}: key {key!r} appears twice in {where}")
            seen.add(key)
            self.expect(":")
            yield key
            nxt = self.skip()
            self.pos += 1
            if nxt == "}":
                return
            if nxt != ",":
                self.pos -= 1
                raise self.fail(f"expected ',' or '}}' in {where}")


def iter_attribute_members(group: str | os.PathLike, key: str, crc32c: int | None = None
                           ) -> Iterator[tuple[str, object]]:
    """``(name, value)`` of each member of the object ``attributes[key]`` of the group at
    ``group``, in file order; ``crc32c``, where recorded, is checked against the file's
    bytes first. NodeNotFoundError when there is no node, ChecksumError or MetadataError
    (naming the file) when it is corrupt, is not a zarr v3 group, or ``attributes[key]``
    is missing or not an object (raised once the document has been walked)."""
    file, raw = read_node_bytes(group, "group")
    if crc32c is not None:
        check_crc32c(raw, crc32c, file)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MetadataError(f"{file} is not valid JSON: {e}") from None
    del raw
    cur = _Cursor(text, file)
    fields: dict = {}
    found = False
    for field in cur.members("the document"):
        if field != "attributes":
            fields[field] = cur.value()
            continue
        if cur.skip() != "{":
            raise MetadataError(f"{file}: 'attributes' must be a JSON object")
        for attr in cur.members("'attributes'"):
            if attr != key:
                cur.value()
                continue
            if cur.skip() != "{":
                raise MetadataError(f"{file}: attribute {key!r} must be a JSON object")
            found = True
            for name in cur.members(f"attribute {key!r}"):
                yield name, cur.value()
    if cur.skip():
        raise cur.fail("extra data after the document")
    _check_group_fields(fields, file)
    if not found:
        raise MetadataError(f"{file}: no {key!r} object in the group's attributes")


def _check_group_fields(fields: dict, file: str) -> None:
    """What ``read_group`` checks of a group's own fields (``attributes`` walked apart)."""
    check_node_fields(fields, file)
    if fields["node_type"] != "group":
        raise MetadataError(f"{file} has node_type {fields['node_type']!r}; expected a group")
