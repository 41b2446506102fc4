"""Checksums over a committed generation's metadata (docs/format.md, "Integrity").

Chunk files have their CRC-32C in the manifest (``checksums.py``). So, since format
version 3, has every other metadata file, byte for byte: each rank's shard table
``rank{r}/zarr.json`` and each array's ``zarr.json``, under the manifest's
``metadata_checksums`` ``{path inside the generation: crc32c}``. The manifest covers itself
with its last member, the **seal**::

    ...,"manifest_crc32c":"89abcdef"}}\\n

eight lowercase hex digits: the CRC-32C of every byte of the file before the key
``"manifest_crc32c"``. The file ends exactly so (the engine writes group metadata as
compact JSON, the attributes last), which fixes where the covered bytes stop without
parsing anything: a reader takes the raw bytes, checks the seal, and only then trusts what
it parses. CRC-32C detects every error of up to 32 consecutive bits, so any single
flipped bit, anywhere in the generation's metadata, is an error naming its file.

Everything works on bytes as read from disk: no canonical form of JSON to agree on.
"""

from __future__ import annotations

import os
import re

import google_crc32c

from ..io import syscalls

from .checksums import ChecksumError, mismatch

SEAL_KEY = "manifest_crc32c"
METADATA_KEY = "metadata_checksums"
_PLACEHOLDER = "0" * 8
_SEAL_TAIL = re.compile(rb'"manifest_crc32c":"([0-9a-f]{8})"}}\n\Z')


def crc32c_of(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``, unsigned 32-bit."""
    return google_crc32c.value(data)


def file_crc32c(path: str) -> int:
    """CRC-32C of the whole file at ``path`` (a metadata file: a shard table of a large
    model is megabytes), read through ``io.syscalls`` as every file of ours is."""
    return crc32c_of(syscalls.read_all(path))


def check_crc32c(data: bytes, expected: int, file: str) -> None:
    """ChecksumError naming ``file`` unless ``data`` (its bytes) has CRC-32C ``expected``."""
    actual = crc32c_of(data)
    if actual != expected:
        raise mismatch(file, actual, expected)


def unsealed_attributes(attributes: dict) -> dict:
    """``attributes`` with the seal's placeholder as their last member: serialised as
    compact JSON (the group's zarr.json), the text ends with ``SEAL_TAIL_PLACEHOLDER``."""
    out = {k: v for k, v in attributes.items() if k != SEAL_KEY}
    out[SEAL_KEY] = _PLACEHOLDER
    return out


SEAL_TAIL_PLACEHOLDER = f'"{SEAL_KEY}":"{_PLACEHOLDER}"}}}}\n'


def seal(text: str) -> str:
    """The zarr.json ``text`` (ending with ``SEAL_TAIL_PLACEHOLDER``) with the placeholder
    replaced by the CRC-32C of the bytes before the key."""
    if not text.endswith(SEAL_TAIL_PLACEHOLDER):  # the attributes must come last
        raise AssertionError("a group document that does not end with the seal's placeholder")
    body = text[:-len(SEAL_TAIL_PLACEHOLDER)]
    return body + f'"{SEAL_KEY}":"{crc32c_of(body.encode("utf-8")):08x}"}}}}\n'


def check_seal(raw: bytes, file: str) -> None:
    """Check the seal of a group's zarr.json whose attributes hold ``SEAL_KEY`` (``raw``:
    its bytes); ChecksumError naming the file when the file does not end with a seal, or
    the bytes before it are not the ones it was made over."""
    m = _SEAL_TAIL.search(raw)
    if m is None:
        raise ChecksumError(f"{file}: has '{SEAL_KEY}' but does not end with it "
                            f"(\"{SEAL_KEY}\":\"<8 hex digits>\"}}}} and a newline): the "
                            f"file is corrupt or was rewritten by hand")
    expected = int(m.group(1), 16)
    actual = crc32c_of(raw[:m.start()])
    if actual != expected:
        raise ChecksumError(f"{file}: checksum mismatch: crc32c of the manifest is "
                            f"{actual:#010x}, its {SEAL_KEY} records {expected:#010x}; the "
                            f"file is corrupt")


def files_crc32c(root: str, names) -> dict[str, int]:
    """``{name: crc32c}`` of the files ``root/<name>`` (the metadata files of a
    generation, named as its manifest names them)."""
    return {name: file_crc32c(os.path.join(root, name)) for name in names}
