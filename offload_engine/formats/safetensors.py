"""safetensors: the header codec (the one place it is encoded and decoded) and a reader of
files and Hugging Face sharded folders.

A file is an 8-byte little-endian header length N, N bytes of JSON
``{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [begin, end]}}``
(offsets relative to the first byte after the header, tensors back to back), then the data.
We write the JSON compact, UTF-8 (not ASCII-escaped, as the safetensors library writes it),
padded with spaces to a multiple of 8 bytes so every tensor stays aligned.

The reader lists tensors from headers only; tied names recorded the way ``consolidate``
and ``safetensors.torch.save_model`` record them (``alias: owner`` in ``__metadata__``, or
in the index's ``metadata``) are aliases. No torch, no ml_dtypes: bytes are read by range.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

from ..dtypes import DType, from_safetensors
from ..io import AsyncFileIO, device_profile
from ..io.align import as_byte_view
from ..layout.metadata import parse_json_object
from .errors import FormatError
from .source import TensorSource, SourceInfo, TensorMeta
from ..errors import InputError

MAX_HEADER = 100 * 1000 * 1000  # bytes: the safetensors crate's limit
# Dimensions of one tensor, and a size in one: torch's limits (64 dimensions in its kernels,
# int64 sizes). Checked before the sizes are multiplied: the product of 100,000 huge sizes
# alone takes minutes.
MAX_NDIM = 64
MAX_DIM = (1 << 63) - 1
# JSON values (objects, arrays, strings, numbers) in a header or index, counted by their
# separators before the JSON is parsed: parsing builds a Python object of 30 to 100 bytes
# for each, so a 100 MB header of `[{},{},...]` built 2.4 GB. A real header of 10,000
# tensors holds about 100,000; 2,000,000 bound the parse to about 200 MB.
MAX_JSON_VALUES = 2_000_000


def _check_json_size(raw: bytes, where: str) -> None:
    """Refuse JSON of more than MAX_JSON_VALUES values (an over-estimate: separators inside
    strings count too), before parsing it."""
    values = raw.count(b",") + raw.count(b"{") + raw.count(b"[") + 1
    if values > MAX_JSON_VALUES:
        raise FormatError(f"{where}: about {values} JSON values; at most {MAX_JSON_VALUES} are read")
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a header: bytes ``[begin, end)`` of the data region. ``dtype`` is None
    only from a shapes-only read (``check_data=False``) of a code outside our table;
    ``code`` is the header's own spelling."""

    dtype: DType | None
    shape: tuple[int, ...]
    begin: int
    end: int
    code: str = ""


# -- the codec -------------------------------------------------------------------------------------
def encode_header(entries: dict[str, HeaderEntry], metadata: dict[str, str]) -> bytes:
    """The header bytes of a file holding ``entries`` (in data order): the 8-byte length,
    then the JSON padded with spaces to a multiple of 8 bytes."""
    doc: dict = {"__metadata__": dict(metadata)}
    for name, e in entries.items():
        if e.dtype.safetensors is None:
            raise InputError(f"{name}: dtype {e.dtype} has no safetensors code")
        doc[name] = {"dtype": e.dtype.safetensors, "shape": list(e.shape),
                     "data_offsets": [e.begin, e.end]}
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def read_header(path: str, *, check_data: bool = True
                ) -> tuple[dict[str, HeaderEntry], dict[str, str], int]:
    """``(entries, __metadata__, data start)`` of the file at ``path``, every entry checked
    (dtype known, shape and offsets well formed). With ``check_data`` the offsets must
    also match the shape and fit the file's size. Without it only names and shapes count
    (the planner's use): a file cut off after its header is fine, and so are a dtype code
    outside our table (``dtype`` None, e.g. a quantisation format) and absent offsets.
    FormatError naming the file otherwise."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FormatError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or (check_data and 8 + n > size):
                raise FormatError(f"{path}: not a safetensors file, or truncated: header "
                                  f"length {n} is impossible for a file of {size} bytes")
            raw = f.read(n)
    except FileNotFoundError:
        raise FormatError(f"{path}: file not found") from None
    except OSError as e:
        raise FormatError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(raw) < n:
        raise FormatError(f"{path}: header cut short ({len(raw)} of {n} bytes; truncated)")
    _check_json_size(raw, f"{path}: the header")
    doc = parse_json_object(raw, f"{path}: the header", FormatError)
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise FormatError(f"{path}: __metadata__ is not an object")
    data_size = size - 8 - n
    entries = {}
    for name, e in doc.items():
        if not isinstance(e, dict):
            raise FormatError(f"{path}: entry {name!r} is not an object")
        code = e.get("dtype")
        try:
            dt = from_safetensors(code)
        except ValueError:
            if check_data or not isinstance(code, str):
                raise FormatError(f"{path}: tensor {name!r} has unsupported dtype "
                                  f"{code!r}") from None
            dt = None
        shape, offs = e.get("shape"), e.get("data_offsets")
        if offs is None and not check_data:
            offs = [0, 0]
        if (not isinstance(shape, list) or len(shape) > MAX_NDIM
                or not all(type(s) is int and 0 <= s <= MAX_DIM for s in shape)
                or not isinstance(offs, list) or len(offs) != 2
                or not all(type(o) is int for o in offs)):
            raise FormatError(f"{path}: tensor {name!r} has a malformed shape or data_offsets (a "
                              f"shape is at most {MAX_NDIM} integers in [0, 2**63))")
        begin, end = offs
        if check_data and (end - begin != math.prod(shape) * dt.itemsize or begin < 0
                           or end > data_size):
            raise FormatError(f"{path}: tensor {name!r}: data_offsets [{begin}, {end}) do not "
                              f"fit its shape {shape} x {e['dtype']} in {data_size} data bytes "
                              f"(truncated file?)")
        entries[name] = HeaderEntry(dt, tuple(shape), begin, end, code)
    return entries, {k: v for k, v in meta.items() if isinstance(v, str)}, 8 + n


def read_index(index: str) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """``(shard files in name order, weight_map, metadata strings)`` of a
    ``model.safetensors.index.json``; FormatError naming it (or a missing shard)."""
    try:
        with open(index, "rb") as f:
            raw = f.read(MAX_HEADER + 1)
    except FileNotFoundError:
        raise FormatError(f"{index}: file not found") from None
    except OSError as e:
        raise FormatError(f"{index}: cannot read: {e.strerror or e}") from None
    if len(raw) > MAX_HEADER:
        raise FormatError(f"{index}: more than {MAX_HEADER} bytes; not a safetensors index")
    _check_json_size(raw, index)
    doc = parse_json_object(raw, index, FormatError)
    wm = doc.get("weight_map")
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise FormatError(f"{index}: no 'weight_map' {{name: file}}; not a safetensors index")
    base = os.path.dirname(index)
    files = []
    for name in sorted(set(wm.values())):
        p = os.path.join(base, name)
        if not os.path.isfile(p):
            raise FormatError(f"{p}: shard named in {os.path.basename(index)} is missing")
        files.append(p)
    meta = doc.get("metadata") or {}
    if not isinstance(meta, dict):
        raise FormatError(f"{index}: 'metadata' must be an object")
    return files, wm, {k: v for k, v in meta.items() if isinstance(v, str)}


# -- the reader ------------------------------------------------------------------------------------
class SafetensorsSource(TensorSource):
    """One .safetensors file, a sharded index, or a folder holding either. Every tensor has
    one state, ``param``."""

    def __init__(self, path: str):
        path = os.path.abspath(path)
        index = None
        if os.path.isdir(path):
            if os.path.isfile(os.path.join(path, INDEX_FILE)):
                index = os.path.join(path, INDEX_FILE)
            else:
                files = sorted(os.path.join(path, f) for f in os.listdir(path)
                               if f.endswith(".safetensors"))
                if not files:
                    raise FormatError(f"{path}: no .safetensors files here")
        elif path.endswith(".json"):
            index = path
        else:
            files = [path]
        index_meta: dict = {}
        if index is not None:
            files, _, index_meta = read_index(index)
        self._where: dict[str, tuple[str, int, HeaderEntry]] = {}  # name -> (file, start, entry)
        metadata: dict = {}
        for f in files:
            entries, meta, start = read_header(f)
            for name, e in entries.items():
                if name in self._where:
                    raise FormatError(f"{f}: tensor {name!r} is also in {self._where[name][0]}")
                self._where[name] = (f, start, e)
            metadata.update(meta)
        metadata.update(index_meta)
        self._aliases = {k: v for k, v in metadata.items()
                         if v in self._where and k not in self._where}
        # buffered: tensors start at any byte (no O_DIRECT alignment); readahead hints on
        read = device_profile.reader_settings(path, 4, mode="buffered")
        self.io_settings = {"read": read.as_dict()}
        self._io = AsyncFileIO(threads=4, read=read, write=read, direct=False)
        fmt = (f"sharded: {len(files)} files + index" if index is not None
               else f"{len(files)} file" + ("s" if len(files) > 1 else ""))
        self.info = SourceInfo(kind="safetensors", path=index or path, format=fmt,
                               files=[(f, os.path.getsize(f)) for f in files])
        if index is not None:
            self.info.files.insert(0, (index, os.path.getsize(index)))
        self._tensors = [TensorMeta.single(n, e.shape, e.dtype)
                         for n, (_, _, e) in self._where.items()]

    def tensors(self) -> list[TensorMeta]:
        return self._tensors

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    def read(self, requests) -> None:
        futures = []
        for req in requests:
            where = self._where.get(self._aliases.get(req.name, req.name))
            if where is None or req.state not in (None, "param"):
                raise FormatError(f"{self.info.path}: no tensor {req.name!r} with state "
                                  f"{req.state!r}")
            file, start, e = where
            dest = as_byte_view(req.out)
            size = e.dtype.itemsize
            if req.start < 0 or req.start * size + len(dest) > e.end - e.begin:
                raise FormatError(f"{req.name}: elements past the end of the tensor")
            futures.append(self._io.read(file, start + e.begin + req.start * size, dest))
        for f in futures:
            f.result()

    def close(self) -> None:
        self._io.close()
