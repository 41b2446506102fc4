"""safetensors files and Hugging Face sharded folders (``model.safetensors.index.json``).

Listing reads each file's header only: 8 bytes of little-endian length N, then N bytes of
JSON ``{name: {dtype, shape, data_offsets}, "__metadata__": {...}}``. Tied names recorded
the way ``consolidate`` and ``safetensors.torch.save_model`` record them (``alias: owner``
in ``__metadata__``, or in the index's ``metadata``) are aliases.
"""

from __future__ import annotations

import json
import math
import os
import struct

import torch

from offload_engine.io import AsyncFileIO

from ..dtypes import to_torch
from ..safetensors_writer import DTYPE_CODES
from .errors import InspectError
from .model import SourceInfo, StateMeta, TensorMeta
from .source import InspectSource, itemsize

MAX_HEADER = 100 * 1000 * 1000  # the safetensors crate's limit
CODES = {code: to_torch(dtype) for dtype, code in DTYPE_CODES.items()}  # inspection works in torch


class _Entry:
    __slots__ = ("file", "offset", "dtype", "shape")

    def __init__(self, file: str, offset: int, dtype: torch.dtype, shape: tuple):
        self.file, self.offset, self.dtype, self.shape = file, offset, dtype, shape


def read_header(path: str) -> tuple[dict, dict, int]:
    """(tensors {name: entry}, __metadata__, data start) of one safetensors file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise InspectError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise InspectError(f"{path}: header length {n} is impossible for a file of "
                                   f"{size} bytes (truncated or not safetensors)")
            raw = f.read(n)
    except FileNotFoundError:
        raise InspectError(f"{path}: file not found") from None
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InspectError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise InspectError(f"{path}: header is not a JSON object")
    meta = doc.pop("__metadata__", None) or {}
    data_start, data_size = 8 + n, size - 8 - n
    out = {}
    for name, e in doc.items():
        if not isinstance(e, dict):
            raise InspectError(f"{path}: entry {name!r} is not an object")
        dtype = CODES.get(e.get("dtype"))
        if dtype is None:
            raise InspectError(f"{path}: tensor {name!r} has unsupported dtype {e.get('dtype')!r}")
        shape, offs = e.get("shape"), e.get("data_offsets")
        if (not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape)
                or not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) for o in offs)):
            raise InspectError(f"{path}: tensor {name!r} has a malformed shape or data_offsets")
        begin, end = offs
        if end - begin != math.prod(shape) * itemsize(dtype) or begin < 0 or end > data_size:
            raise InspectError(f"{path}: tensor {name!r}: data_offsets [{begin}, {end}) do not fit "
                               f"its shape {shape} x {e['dtype']} in {data_size} data bytes "
                               f"(truncated file?)")
        out[name] = _Entry(path, data_start + begin, dtype, tuple(shape))
    return out, meta, data_start


class SafetensorsSource(InspectSource):
    """One .safetensors file, a sharded index, or a folder holding either."""

    def __init__(self, path: str):
        path = os.path.abspath(path)
        index = None
        if os.path.isdir(path):
            if os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
                index = os.path.join(path, "model.safetensors.index.json")
                files = None
            else:
                files = sorted(os.path.join(path, f) for f in os.listdir(path)
                               if f.endswith(".safetensors"))
                if not files:
                    raise InspectError(f"{path}: no .safetensors files here")
        elif path.endswith(".json"):
            index, files = path, None
        else:
            files = [path]
        meta_aliases: dict = {}
        if index is not None:
            files, meta_aliases = self._read_index(index)
        self._entries: dict[str, _Entry] = {}
        metadata: dict = {}
        for f in files:
            entries, meta, _ = read_header(f)
            for name in entries:
                if name in self._entries:
                    raise InspectError(f"{f}: tensor {name!r} is also in {self._entries[name].file}")
            self._entries.update(entries)
            metadata.update({k: v for k, v in meta.items() if isinstance(v, str)})
        metadata.update(meta_aliases)
        self._aliases = {k: v for k, v in metadata.items()
                         if v in self._entries and k not in self._entries}
        self._io = AsyncFileIO(threads=4, queue_depth=4, direct=False)
        fmt = (f"sharded: {len(files)} files + index" if index is not None
               else f"{len(files)} file" + ("s" if len(files) > 1 else ""))
        self.info = SourceInfo(kind="safetensors", path=index or path, format=fmt,
                               files=[(f, os.path.getsize(f)) for f in files])
        if index is not None:
            self.info.files.insert(0, (index, os.path.getsize(index)))
        self._tensors = [TensorMeta(n, e.shape, e.dtype, None,
                                    {"param": StateMeta(e.dtype, math.prod(e.shape),
                                                        {None: math.prod(e.shape) * itemsize(e.dtype)})})
                         for n, e in self._entries.items()]

    @staticmethod
    def _read_index(index: str) -> tuple[list[str], dict]:
        try:
            with open(index, encoding="utf-8") as f:
                doc = json.load(f)
        except FileNotFoundError:
            raise InspectError(f"{index}: file not found") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InspectError(f"{index}: not valid JSON ({e})") from None
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise InspectError(f"{index}: no 'weight_map' {{name: file}}; not a safetensors index")
        base = os.path.dirname(index)
        files = []
        for name in sorted(set(wm.values())):
            p = os.path.join(base, name)
            if not os.path.isfile(p):
                raise InspectError(f"{p}: shard named in {os.path.basename(index)} is missing")
            files.append(p)
        meta = doc.get("metadata") or {}
        aliases = {k: v for k, v in meta.items() if isinstance(v, str)}
        return files, aliases

    def tensors(self) -> list[TensorMeta]:
        return self._tensors

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    def read(self, name: str, state: str, start: int, out: torch.Tensor) -> None:
        e = self._entries.get(name)
        if e is None or state != "param":
            raise InspectError(f"{self.info.path}: no tensor {name!r} with state {state!r}")
        if start + out.numel() > math.prod(e.shape):
            raise InspectError(f"{name}: elements past the end of the tensor")
        self._io.read(e.file, e.offset + start * itemsize(e.dtype), out).result()

    def close(self) -> None:
        self._io.close()
