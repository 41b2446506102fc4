"""zarr.json: reading, validating and atomically rewriting zarr v3 node metadata.

A node (array or group) is a directory holding ``zarr.json``. This module turns an array's
``zarr.json`` into :class:`ArrayMetadata`, deciding once, at open, whether the engine can
move its chunk bytes itself ("direct I/O": one uncompressed little-endian ``bytes`` codec)
or must leave decoding to zarr-python, or cannot serve the array at all. Anything it cannot
vouch for is refused with an error that names the file and the feature, never guessed at.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from dataclasses import dataclass, field
from typing import Iterable

from .. import dtypes
from ..dtypes import DType
from ..io import syscalls
from ..io.errors import FileIOError
from ..units import PAGE  # chunk files of our arrays are a whole number of pages (O_DIRECT)
from .fill_values import default_fill_json, fill_to_bytes
from .metadata_crc import check_crc32c
from ..errors import InputError, OffloadEngineError

ZARR_JSON = "zarr.json"

_KNOWN_ARRAY_KEYS = {"zarr_format", "node_type", "shape", "data_type", "chunk_grid",
                     "chunk_key_encoding", "fill_value", "codecs", "attributes",
                     "storage_transformers", "dimension_names"}
_REQUIRED_ARRAY_KEYS = ("shape", "data_type", "chunk_grid", "chunk_key_encoding",
                        "fill_value", "codecs")


class MetadataError(InputError):
    """A zarr.json that is unreadable, not valid JSON, or not valid zarr v3 metadata."""


class ForeignArrayError(InputError):
    """A valid zarr v3 array using a feature the engine does not serve (this way).

    The message names the array and the feature, e.g. "codec 'zstd' is not supported for
    direct I/O".
    """


class NodeNotFoundError(OffloadEngineError, FileNotFoundError):
    """No zarr node (no ``zarr.json``) at a path."""


# -- reading and writing zarr.json -------------------------------------------------------------
def metadata_path(node_path: str | os.PathLike) -> str:
    return os.path.join(os.fspath(node_path), ZARR_JSON)


def read_node(node_path: str | os.PathLike, kind: str = "node", crc32c: int | None = None) -> dict:
    """The parsed ``zarr.json`` of a zarr v3 node, checked for zarr_format 3 and a node_type.

    ``kind`` ("array", "group" or "node") only words the not-found error. ``crc32c``: the
    checksum a checkpoint manifest records for the file; its bytes are checked against it
    before they are parsed. Raises NodeNotFoundError, ChecksumError or MetadataError, each
    naming the file.
    """
    file, raw = read_node_bytes(node_path, kind)
    if crc32c is not None:
        check_crc32c(raw, crc32c, file)
    return parse_node(raw, file)


def read_node_bytes(node_path: str | os.PathLike, kind: str = "node") -> tuple[str, bytes]:
    """``(path of zarr.json, its bytes)``; NodeNotFoundError or MetadataError naming it."""
    file = metadata_path(node_path)
    try:
        return file, syscalls.read_all(file)
    except FileNotFoundError:
        where = "does not exist" if not os.path.exists(node_path) else "has no zarr.json"
        raise NodeNotFoundError(f"no zarr {kind} at {os.fspath(node_path)!r}: the directory "
                                f"{where} (expected {file})") from None
    except OSError as e:
        raise MetadataError(f"cannot read {file}: {e}") from e


def parse_node(raw: bytes, file: str) -> dict:
    """The bytes of ``file`` (a zarr.json) parsed and checked as zarr v3 node metadata."""
    doc = parse_json_object(raw, file, MetadataError)
    check_node_fields(doc, file)
    return doc


def check_node_fields(doc: dict, file: str) -> None:
    """MetadataError naming ``file`` unless ``doc``'s own fields are a zarr v3 node's:
    zarr_format 3, node_type 'array' or 'group', attributes (if any) an object."""
    if "zarr_format" not in doc:
        raise MetadataError(f"{file} has no 'zarr_format' key")
    if doc["zarr_format"] != 3:
        raise MetadataError(f"{file} has zarr_format {doc['zarr_format']!r}; only zarr v3 "
                            f"(zarr_format 3) is supported")
    if doc.get("node_type") not in ("array", "group"):
        raise MetadataError(f"{file} has node_type {doc.get('node_type')!r}; expected "
                            f"'array' or 'group'")
    if not isinstance(doc.get("attributes", {}), dict):
        raise MetadataError(f"{file}: 'attributes' must be a JSON object")


def parse_json_object(raw: bytes, what: str, error: type[Exception]) -> dict:
    """``raw`` parsed as a JSON object; ``error`` naming ``what`` (a file) otherwise."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{what} is not valid JSON: {e}") from None
    except RecursionError:
        raise error(f"{what} is not valid JSON: nested too deeply") from None
    if not isinstance(doc, dict):
        raise error(f"{what} must hold a JSON object, found {type(doc).__name__}")
    return doc


def write_json_atomic(file: str | os.PathLike, doc: dict, *, compact: bool = False) -> None:
    """Replace ``file`` with ``doc`` as JSON so readers see the old or the new file, never a mix.

    ``compact`` drops indentation and spaces: group manifests can hold tens of thousands
    of entries, and indented they are twice the bytes to read and parse. Array metadata
    stays indented (a few hundred bytes, read by people).
    """
    text = compact_json(doc) if compact else json.dumps(doc, allow_nan=False, indent=2)
    write_text_atomic(file, text + "\n")


def compact_json(doc) -> str:
    """``doc`` as compact strict JSON (no NaN), as group manifests are written."""
    return json.dumps(doc, allow_nan=False, separators=(",", ":"))


@contextlib.contextmanager
def replacing(file: str | os.PathLike):
    """Yield the path of a new, empty temporary file next to ``file``; when the block ends
    without an error, rename it over ``file`` and fsync the directory so the rename itself
    survives a crash. On an error the temporary file is removed and ``file`` is untouched.
    Writers fsync the temporary file themselves (they know when its bytes are complete).

    The temporary file is created here under a new random name, exclusively and never
    through a symlink (O_EXCL | O_NOFOLLOW), so writers open a regular file of ours. A
    failure of this function's own calls is a FileIOError naming ``file``."""
    file = os.fspath(file)
    directory = os.path.dirname(os.path.abspath(file))
    tmp = os.path.join(directory, f".{os.path.basename(file)}.{uuid.uuid4().hex}.tmp")
    try:
        try:
            os.close(syscalls.open_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                                      | syscalls.NOFOLLOW | syscalls.CLOEXEC, 0o644))
        except OSError as e:
            raise FileIOError(e.errno, "create", file,
                              detail=f"{e.strerror} (its temporary file {tmp})") from e
        yield tmp
        try:
            syscalls.replace(tmp, file)
        except OSError as e:
            raise FileIOError(e.errno, "rename", file,
                              detail=f"{e.strerror} (renaming {tmp} over it)") from e
    except BaseException:
        try:
            syscalls.unlink(tmp)
        except OSError:
            pass  # best effort: a hidden temporary file, and the error that matters is raised
        raise
    fsync_dir(directory)


def write_text_atomic(file: str | os.PathLike, text: str | Iterable[bytes]) -> int:
    """Replace ``file`` with ``text`` (UTF-8), or with the bytes ``text``'s chunks hold one
    after the other, each written as it is produced (a manifest too large to hold whole:
    ``group_stream.py``): a temporary file in the same directory, fsynced, renamed over
    ``file``, and the directory fsynced. Any failure (a full disk included) is a
    FileIOError naming ``file``; ``file`` is then untouched, also when the producer of the
    chunks raises. Returns the bytes written."""
    chunks = [text.encode("utf-8")] if isinstance(text, str) else text
    size, data = 0, b""
    with replacing(file) as tmp:
        op = "open"
        try:
            fd = syscalls.open_fd(tmp, os.O_WRONLY | syscalls.NOFOLLOW | syscalls.CLOEXEC)
            try:
                op = "write"
                for data in chunks:
                    syscalls.write_all(fd, data, tmp)
                    size += len(data)
                op = "fsync"
                syscalls.fsync(fd, tmp)
            finally:
                os.close(fd)
        except OSError as e:
            whole = op == "write"
            raise FileIOError(e.errno, op, file, size if whole else None,
                              len(data) if whole else None) from e
    return size


def write_bytes_atomic(file: str | os.PathLike, chunks: Iterable[bytes]) -> int:
    """``write_text_atomic`` of byte chunks (the fault-injection site stays that function's,
    so a full disk is simulated for every metadata file alike)."""
    return write_text_atomic(file, chunks)


def fsync_dir(directory: str | os.PathLike) -> None:
    """fsync a directory so entries created or renamed in it are durable; a failure is a
    FileIOError naming it."""
    directory = os.fspath(directory)
    try:
        fd = syscalls.open_fd(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
                              | syscalls.CLOEXEC)
    except OSError as e:
        raise FileIOError(e.errno, "open", directory) from e
    try:
        syscalls.fsync(fd, directory)
    except OSError as e:
        raise FileIOError(e.errno, "fsync", directory) from e
    finally:
        os.close(fd)


# -- array metadata ----------------------------------------------------------------------------
@dataclass
class ArrayMetadata:
    """What the engine needs from an array's zarr.json.

    ``direct_problem`` is None when the engine reads and writes the chunk files itself;
    otherwise it says why not (reads then go through zarr-python, writes are refused).
    """

    path: str
    numel: int  # elements
    element: DType
    chunk_elems: int  # elements per chunk
    key_prefix: str  # chunk i lives at <path>/<key_prefix><i>
    fill_bytes: bytes  # one element, little endian
    direct_problem: str | None
    doc: dict = field(repr=False)  # the whole zarr.json, unknown-but-harmless keys included

    @property
    def attributes(self) -> dict:
        return self.doc.get("attributes", {})

    @property
    def file(self) -> str:
        return metadata_path(self.path)

    def chunk_key(self, index: int) -> str:
        return f"{self.key_prefix}{index}"


def new_array_doc(numel: int, element: DType, chunk_elems: int, attributes: dict,
                  dimension_name: str) -> dict:
    """The zarr.json the engine writes for a 1-D flat array of ``numel`` elements."""
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [numel],
        "data_type": element.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [chunk_elems]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": default_fill_json(element),
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        "attributes": attributes,
        "dimension_names": [dimension_name],
        "storage_transformers": [],
    }


def parse_array(path: str, doc: dict) -> ArrayMetadata:
    """Validate an array's zarr.json (as read by :func:`read_node`).

    Raises MetadataError for metadata that is not valid zarr v3, and ForeignArrayError for
    valid metadata the engine cannot serve at all (not 1-D, unsupported data type, storage
    transformers, irregular grid, unknown chunk key encoding or extension field).
    """
    file = metadata_path(path)
    if doc.get("node_type") != "array":
        raise MetadataError(f"{file} describes a {doc.get('node_type')}, not an array")
    for key in _REQUIRED_ARRAY_KEYS:
        if key not in doc:
            raise MetadataError(f"{file} is missing the required key {key!r}")
    _check_extensions(path, doc)

    shape = doc["shape"]
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise MetadataError(f"{file}: 'shape' must be a list of non-negative integers, "
                            f"got {shape!r}")
    if len(shape) != 1:
        raise ForeignArrayError(f"array {path} is {len(shape)}-dimensional (shape {shape}); "
                                f"only 1-D flat arrays are supported")
    element = dtypes.BY_NAME.get(doc["data_type"]) if isinstance(doc["data_type"], str) else None
    if element is None or not element.zarr:
        raise ForeignArrayError(f"array {path}: data type {doc['data_type']!r} is not "
                                f"supported (supported: {', '.join(dtypes.ZARR_NAMES)})")
    if doc.get("storage_transformers"):
        raise ForeignArrayError(f"array {path}: storage transformers are not supported")
    chunk_elems = _parse_chunk_grid(path, doc["chunk_grid"])
    key_prefix = _parse_key_encoding(path, doc["chunk_key_encoding"])
    try:
        fill_bytes = fill_to_bytes(element, doc["fill_value"])
    except ValueError as e:
        raise MetadataError(f"{file}: invalid fill_value: {e}") from None
    return ArrayMetadata(path=path, numel=shape[0], element=element, chunk_elems=chunk_elems,
                         key_prefix=key_prefix,
                         fill_bytes=fill_bytes,
                         direct_problem=_direct_problem(path, doc["codecs"], element),
                         doc=doc)


def _is_count(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _check_extensions(path: str, doc: dict) -> None:
    # zarr v3: an unknown field must be understood unless it says must_understand: false.
    for key, value in doc.items():
        if key in _KNOWN_ARRAY_KEYS:
            continue
        if isinstance(value, dict) and value.get("must_understand") is False:
            continue
        raise ForeignArrayError(f"array {path}: metadata field {key!r} is an extension the "
                                f"engine does not understand")


def _parse_chunk_grid(path: str, grid) -> int:
    file = metadata_path(path)
    if not isinstance(grid, dict) or "name" not in grid:
        raise MetadataError(f"{file}: 'chunk_grid' must be an object with a name")
    if grid["name"] != "regular":
        raise ForeignArrayError(f"array {path}: chunk grid {grid['name']!r} is not supported "
                                f"(only 'regular')")
    shape = (grid.get("configuration") or {}).get("chunk_shape")
    if not isinstance(shape, list) or len(shape) != 1 or not _is_count(shape[0]) \
            or shape[0] == 0:
        raise MetadataError(f"{file}: chunk_grid chunk_shape must be one positive integer "
                            f"for a 1-D array, got {shape!r}")
    return shape[0]


def _parse_key_encoding(path: str, encoding) -> str:
    file = metadata_path(path)
    if not isinstance(encoding, dict) or "name" not in encoding:
        raise MetadataError(f"{file}: 'chunk_key_encoding' must be an object with a name")
    name = encoding["name"]
    config = encoding.get("configuration") or {}
    if name == "default":
        sep = config.get("separator", "/")
        if sep not in ("/", "."):
            raise MetadataError(f"{file}: chunk key separator {sep!r} is not '/' or '.'")
        return "c" + sep
    if name == "v2":
        # A 1-D v2 key is the bare decimal index whatever the separator.
        return ""
    raise ForeignArrayError(f"array {path}: chunk key encoding {name!r} is not supported")


def _direct_problem(path: str, codecs, element: DType) -> str | None:
    """None when chunk files are raw little-endian elements, else why they are not."""
    file = metadata_path(path)
    if not isinstance(codecs, list) or not codecs:
        raise MetadataError(f"{file}: 'codecs' must be a non-empty list")
    names = []
    for codec in codecs:
        name = codec if isinstance(codec, str) else (codec.get("name") if isinstance(codec, dict) else None)
        if not isinstance(name, str):
            raise MetadataError(f"{file}: every codec needs a name, got {codec!r}")
        names.append(name)
    for name in names:
        if name != "bytes":
            return f"codec {name!r} is not supported for direct I/O"
    if len(names) > 1:
        return "more than one 'bytes' codec is not supported for direct I/O"
    config = {}
    if isinstance(codecs[0], dict):
        config = codecs[0].get("configuration") or {}
    endian = config.get("endian")
    if endian is None and element.itemsize > 1:
        raise MetadataError(f"{file}: the bytes codec needs an 'endian' for the "
                            f"{element.itemsize}-byte type {element.name}")
    if endian == "big" and element.itemsize > 1:
        return "big-endian bytes codec is not supported for direct I/O"
    if endian not in (None, "little", "big"):
        raise MetadataError(f"{file}: bytes codec endian {endian!r} is not 'little' or 'big'")
    return None


def json_attributes(attributes, what: str) -> dict:
    """A copy of ``attributes``, checked to be a dict that strict JSON can hold; errors
    start with ``what`` (e.g. "array /x" or "group /y")."""
    if not isinstance(attributes, dict):
        raise InputError(f"{what}: attributes must be a dict, got {type(attributes).__name__}")
    try:
        json.dumps(attributes, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InputError(f"{what}: attributes are not JSON-serialisable: {e}") from None
    return dict(attributes)
