"""The zip container of a ``torch.save`` file: where each record's bytes lie, read from the
zip's directory and local headers, never from the records themselves.

Only the zip's end records, its central directory and, per record, its 30-byte local
header are read. The directory's size is checked (``pt_limits.MAX_RECORDS``,
``MAX_CENTRAL_DIRECTORY``) before ``zipfile`` parses it, and no record is ever
decompressed (torch.save stores every record). Storage records (one per tensor: a ZeRO-3
model states file of a mixture-of-experts model has 100,000) are kept as arrays, not as
one ``ZipInfo`` object each.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from . import pt_limits as limits
from .errors import FormatError


class CheckpointFileError(FormatError):
    """A file that cannot be read as a checkpoint (missing, truncated, corrupt, unsafe).

    The message starts with the file's path and says what is wrong.
    """


_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zip local file header, 30 bytes


@dataclass(frozen=True, slots=True)
class RecordSpan:
    """Where a record's bytes lie in the file: ``[offset, offset + nbytes)``."""

    name: str
    offset: int
    nbytes: int


_EOCD = struct.Struct("<4sHHHHIIH")         # end of central directory record, 22 bytes
_EOCD64_LOCATOR = struct.Struct("<4sIQI")    # zip64 end of central directory locator, 20 bytes
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")      # zip64 end of central directory record, 56 bytes
_MAX_ZIP_COMMENT = 0xFFFF


def _central_directory_size(f, file_size: int) -> tuple[int, int] | None:
    """(entries, bytes) the zip's central directory declares, read from its end records
    without parsing the directory; None when no end record is found (``zipfile`` then
    reports the file as not a zip)."""
    tail_len = min(file_size, _EOCD.size + _MAX_ZIP_COMMENT)
    f.seek(file_size - tail_len)
    tail = f.read(tail_len)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + _EOCD.size > len(tail):
        return None
    _, _, _, _, entries, cd_bytes, cd_offset, _ = _EOCD.unpack_from(tail, at)
    if entries == 0xFFFF or cd_bytes == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:
        locator_at = file_size - tail_len + at - _EOCD64_LOCATOR.size
        if locator_at >= 0:
            f.seek(locator_at)
            sig, _, eocd64_at, _ = _EOCD64_LOCATOR.unpack(f.read(_EOCD64_LOCATOR.size))
            if sig == b"PK\x06\x07" and eocd64_at + _EOCD64.size <= file_size:
                f.seek(eocd64_at)
                fields = _EOCD64.unpack(f.read(_EOCD64.size))
                if fields[0] == b"PK\x06\x06":
                    entries, cd_bytes = fields[7], fields[8]
    return entries, cd_bytes


class PtArchive:
    """The records of one ``torch.save`` zip file, located without reading their data.

    Only the zip's end records, its central directory and, per record, its 30-byte local
    header are read. The directory's size is checked (``pt_limits.MAX_RECORDS``,
    ``MAX_CENTRAL_DIRECTORY``) before ``zipfile`` parses it, and no record is ever
    decompressed (torch.save stores every record).
    """

    def __init__(self, path: str):
        self.path = os.fspath(path)
        try:
            with open(self.path, "rb") as f:
                self.size = os.fstat(f.fileno()).st_size
                declared = _central_directory_size(f, self.size)
                if declared is not None:
                    entries, cd_bytes = declared
                    if entries > limits.MAX_RECORDS or cd_bytes > limits.MAX_CENTRAL_DIRECTORY:
                        raise CheckpointFileError(
                            f"{self.path}: zip directory of {entries} records ({cd_bytes} bytes); "
                            f"at most {limits.MAX_RECORDS} records and "
                            f"{limits.MAX_CENTRAL_DIRECTORY} bytes are read")
                with zipfile.ZipFile(f) as zf:
                    infos = zf.infolist()
                if len(infos) > limits.MAX_RECORDS:
                    raise CheckpointFileError(f"{self.path}: zip directory of {len(infos)} records; "
                                              f"at most {limits.MAX_RECORDS} are read")
        except FileNotFoundError:
            raise CheckpointFileError(f"{self.path}: file not found") from None
        except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, EOFError, struct.error,
                ValueError) as e:
            if isinstance(e, CheckpointFileError):
                raise
            raise CheckpointFileError(
                f"{self.path}: not a readable torch checkpoint (truncated or corrupt zip: {e})") from None
        except OSError as e:
            raise CheckpointFileError(f"{self.path}: cannot read ({e.strerror or e})") from None
        pkl = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
        if len(pkl) != 1:
            raise CheckpointFileError(f"{self.path}: zip holds no single data.pkl; not a torch.save file")
        self.prefix = pkl[0].filename[: -len("data.pkl")]
        # Storage records (one per tensor: a ZeRO-3 model file has one per parameter) are
        # kept as arrays, not as ZipInfo objects (about 0.5 KB each): their keys, the byte of
        # each local header and their sizes; the few other records keep their ZipInfo.
        data = self.prefix + "data/"
        self._infos = {i.filename: i for i in infos if not i.filename.startswith(data)}
        stored = [i for i in infos if i.filename.startswith(data)]
        del infos
        self._keys = {i.filename[len(data):]: k for k, i in enumerate(stored)}
        for i in stored:
            if i.compress_type != zipfile.ZIP_STORED or i.compress_size != i.file_size:
                raise CheckpointFileError(f"{self.path}: record {i.filename} is compressed; "
                                          f"torch.save never compresses (not a torch checkpoint?)")
        self._header_at = np.fromiter((i.header_offset for i in stored), np.int64, len(stored))
        self._nbytes = np.fromiter((i.file_size for i in stored), np.int64, len(stored))
        del stored
        self._data_at: np.ndarray | None = None  # where each record's bytes start (located lazily)

    def read_record(self, name: str, max_bytes: int = limits.MAX_SMALL_RECORD) -> bytes:
        """The bytes of a small record (data.pkl, byteorder), CRC-checked; a record over
        ``max_bytes`` bytes, or a compressed one, is refused before anything is read."""
        info = self._infos.get(self.prefix + name)
        if info is None:
            raise CheckpointFileError(f"{self.path}: record {name!r} missing")
        try:
            with open(self.path, "rb") as f:
                span = self._locate(f, info)
                if span.nbytes > max_bytes:
                    raise CheckpointFileError(
                        f"{self.path}: record {name!r} has {span.nbytes} bytes; at most "
                        f"{max_bytes} are read")
                f.seek(span.offset)
                data = f.read(span.nbytes)
        except OSError as e:
            raise CheckpointFileError(f"{self.path}: record {name!r} unreadable ({e.strerror or e})") from None
        if len(data) != span.nbytes or zlib.crc32(data) != info.CRC:
            raise CheckpointFileError(f"{self.path}: record {name!r} is corrupt (its CRC-32 does "
                                      f"not match; truncated or altered file)")
        return data

    def storage_spans(self) -> dict[str, RecordSpan]:
        """Every ``data/<key>`` record's byte span, by storage key (a new dict per call:
        ``storage_records`` walks them without one)."""
        return {key: RecordSpan(f"{self.prefix}data/{key}", offset, nbytes)
                for key, offset, nbytes in self.storage_records()}

    def forget_empty_records(self, keep: set[str]) -> None:
        """Forget the storage records of no bytes but those in ``keep`` (a trimmed file's
        placeholders: ``record_span`` then says they are missing)."""
        self._keys = {key: k for key, k in self._keys.items() if key in keep or self._nbytes[k]}

    def storage_records(self) -> Iterator[tuple[str, int, int]]:
        """``(storage key, file byte offset, bytes)`` of every ``data/<key>`` record."""
        data_at = self._located()
        for key, k in self._keys.items():
            yield key, int(data_at[k]), int(self._nbytes[k])

    def record_span(self, key: str) -> RecordSpan:
        k = self._keys.get(key)
        if k is None:
            raise CheckpointFileError(f"{self.path}: storage record data/{key} missing")
        return RecordSpan(f"{self.prefix}data/{key}", int(self._located()[k]), int(self._nbytes[k]))

    def _located(self) -> np.ndarray:
        """Each storage record's first data byte, from its local header (read once)."""
        if self._data_at is None:
            data_at = np.empty_like(self._header_at)
            names = {k: key for key, k in self._keys.items()}
            with open(self.path, "rb") as f:
                for k in range(len(data_at)):
                    data_at[k] = self._data_offset(f, f"{self.prefix}data/{names[k]}",
                                                   int(self._header_at[k]), int(self._nbytes[k]))
            self._data_at = data_at
        return self._data_at

    def _locate(self, f, info: zipfile.ZipInfo) -> RecordSpan:
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise CheckpointFileError(f"{self.path}: record {info.filename} is compressed; "
                                      f"torch.save never compresses (not a torch checkpoint?)")
        offset = self._data_offset(f, info.filename, info.header_offset, info.file_size)
        return RecordSpan(info.filename, offset, info.file_size)

    def _data_offset(self, f, name: str, header_offset: int, nbytes: int) -> int:
        """The first data byte of record ``name``, from its local header; errors name it."""
        f.seek(header_offset)
        raw = f.read(_LOCAL_HEADER.size)
        if len(raw) < _LOCAL_HEADER.size or raw[:4] != b"PK\x03\x04":
            raise CheckpointFileError(f"{self.path}: bad zip local header for {name} "
                                      f"at byte {header_offset} (corrupt file)")
        fields = _LOCAL_HEADER.unpack(raw)
        name_len, extra_len = fields[9], fields[10]
        offset = header_offset + _LOCAL_HEADER.size + name_len + extra_len
        if offset + nbytes > self.size:
            raise CheckpointFileError(
                f"{self.path}: record {name} ends at byte {offset + nbytes} "
                f"but the file has {self.size} bytes (truncated)")
        return offset
