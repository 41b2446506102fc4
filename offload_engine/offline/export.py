"""Write one logical tensor, reassembled from its shards, as .npy, .safetensors or .pt.

.npy and .safetensors are streamed window by window (memory stays at two windows whatever
the tensor's size); .pt goes through ``torch.save`` and holds the whole tensor in memory.
The file appears complete or not at all: it is written next to its destination under a
temporary name, synced, then renamed.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import torch

from offload_engine.io import BufferPool
from offload_engine import dtypes
from offload_engine.layout.metadata import replacing

from ..dtypes import as_dtype
from ..safetensors_writer import DTYPE_CODES
from .errors import InspectError
from .model import TensorMeta
from .source import MiB, InspectSource, itemsize

FORMATS = (".npy", ".safetensors", ".pt")


def pick_state(t: TensorMeta, state: str | None) -> str:
    """``state``, or the tensor's value (master, param, or its only state)."""
    if state is not None:
        if state not in t.states:
            raise InspectError(f"tensor {t.name!r} has no state {state!r} (it has: "
                               f"{', '.join(t.states)})")
        return state
    chosen = t.weight_state()
    if chosen is None:
        raise InspectError(f"tensor {t.name!r} has several states ({', '.join(t.states)}); "
                           f"pick one with --state")
    return chosen


def _numpy_dtype(dtype: torch.dtype, path: str) -> np.dtype:
    if dtype == torch.bfloat16:
        raise InspectError(f"{path}: numpy has no bfloat16; pass --dtype float32 or write "
                           f".safetensors / .pt")
    try:
        return dtypes.dtype(dtype).numpy
    except ValueError as e:
        raise InspectError(f"{path}: {e}") from None


def export_tensor(source: InspectSource, name: str, out_path: str, state: str | None = None,
                  dtype: torch.dtype | None = None, window_bytes: int = 16 * MiB) -> dict:
    """Reassemble ``name``'s ``state`` and write it to ``out_path`` (format from the
    extension). ``dtype`` casts it (floats round to nearest even). Returns a summary."""
    ext = os.path.splitext(out_path)[1].lower()
    if ext not in FORMATS:
        raise InspectError(f"{out_path}: unknown output format {ext or '(no extension)'!r}; "
                           f"use {', '.join(FORMATS)}")
    t = source.tensor(name)
    state = pick_state(t, state)
    src_dtype = t.states[state].dtype
    out_dtype = dtype or src_dtype
    out_dir = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(out_dir):
        raise InspectError(f"{out_path}: the folder {out_dir} does not exist")
    with replacing(out_path) as tmp:
        if ext == ".pt":
            full = torch.empty(t.numel, dtype=src_dtype)
            source.read(t.name, state, 0, full)
            torch.save(full.to(out_dtype).reshape(t.shape), tmp)
        else:
            if ext == ".npy":
                header = _npy_header(_numpy_dtype(out_dtype, out_path), t.shape)
            else:
                header = _safetensors_header(name, state, out_dtype, t.shape)
            with open(tmp, "wb") as f:
                f.write(header)
                _stream(source, t, state, out_dtype, f, window_bytes)
                f.flush()
                os.fsync(f.fileno())
    return {"name": name, "state": state, "shape": list(t.shape),
            "dtype": str(out_dtype).removeprefix("torch."), "path": out_path,
            "bytes": os.path.getsize(out_path)}


def _stream(source: InspectSource, t: TensorMeta, state: str, out_dtype: torch.dtype, f,
            window_bytes: int) -> None:
    src_dtype = t.states[state].dtype
    per = max(1, window_bytes // max(itemsize(src_dtype), itemsize(out_dtype)))
    with BufferPool(2 * window_bytes + 8192) as pool:
        with pool.acquire(per * itemsize(src_dtype)) as sb, \
                pool.acquire(per * itemsize(out_dtype)) as ob:
            for lo in range(0, t.numel, per):
                n = min(per, t.numel - lo)
                data = sb.view(src_dtype, n)
                source.read(t.name, state, lo, data)
                if out_dtype != src_dtype:
                    out = ob.view(out_dtype, n)
                    out.copy_(data)
                    data = out
                f.write(memoryview(data.view(torch.uint8).numpy()))


def _npy_header(dtype: np.dtype, shape: tuple) -> bytes:
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_2_0(
        buf, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
              "shape": tuple(shape)})
    return buf.getvalue()


def _safetensors_header(name: str, state: str, dtype: torch.dtype, shape: tuple) -> bytes:
    try:
        code = DTYPE_CODES[as_dtype(dtype)]
    except (KeyError, ValueError):
        raise InspectError(f"safetensors has no dtype code for {dtype}") from None
    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize(dtype)
    doc = {"__metadata__": {"format": "pt", "state": state},
           name: {"dtype": code, "shape": list(shape), "data_offsets": [0, nbytes]}}
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw
