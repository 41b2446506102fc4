"""Write one logical tensor, reassembled from its shards, as .npy, .safetensors or .pt.

.npy and .safetensors are streamed window by window (memory stays at two windows whatever
the tensor's size); .pt goes through ``torch.save`` and holds the whole tensor in memory.
The file appears complete or not at all: it is written next to its destination under a
temporary name, synced, then renamed.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from .. import dtypes
from ..dtypes import DType
from ..formats.errors import FormatError
from ..formats.safetensors import HeaderEntry, encode_header
from ..formats.source import TensorSource, TensorMeta
from ..io import BufferPool
from ..layout.metadata import replacing
from ..units import MiB

FORMATS = (".npy", ".safetensors", ".pt")


def pick_state(t: TensorMeta, state: str | None) -> str:
    """``state``, or the tensor's value (master, param, or its only state)."""
    if state is not None:
        if state not in t.states:
            raise FormatError(f"tensor {t.name!r} has no state {state!r} (it has: "
                               f"{', '.join(t.states)})")
        return state
    chosen = t.weight_state()
    if chosen is None:
        raise FormatError(f"tensor {t.name!r} has several states ({', '.join(t.states)}); "
                           f"pick one with --state")
    return chosen


def _numpy_dtype(dtype: DType, path: str) -> np.dtype:
    if dtype.name == "bfloat16":
        raise FormatError(f"{path}: numpy has no bfloat16; pass --dtype float32 or write "
                          f".safetensors / .pt")
    if not dtype.zarr:  # float8 and complex: no .npy spelling we vouch for
        raise FormatError(f"{path}: dtype {dtype} cannot be written as .npy")
    return dtype.numpy


def export_tensor(source: TensorSource, name: str, out_path: str, state: str | None = None,
                  dtype=None, window_bytes: int = 16 * MiB, progress=None) -> dict:
    """Reassemble ``name``'s ``state`` and write it to ``out_path`` (format from the
    extension). ``dtype`` (anything ``dtypes.dtype`` takes) casts it (floats round to
    nearest even). ``progress(bytes read, total bytes)`` after each window (.npy and
    .safetensors; .pt is written in one call). Returns a summary."""
    ext = os.path.splitext(out_path)[1].lower()
    if ext not in FORMATS:
        raise FormatError(f"{out_path}: unknown output format {ext or '(no extension)'!r}; "
                          f"use {', '.join(FORMATS)}")
    t = source.tensor(name)
    state = pick_state(t, state)
    src_dtype = t.states[state].dtype
    out_dtype = src_dtype if dtype is None else dtypes.dtype(dtype)
    out_dir = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(out_dir):
        raise FormatError(f"{out_path}: the folder {out_dir} does not exist")
    check = getattr(source, "check_readable", None)
    if check is not None:  # before a buffer or file is sized by the tensor's shape
        check([(t.name, state)])
    with replacing(out_path) as tmp:
        if ext == ".pt":
            full = torch.empty(t.numel, dtype=src_dtype.torch)
            source.read_state(t.name, state, 0, full)
            torch.save(full.to(out_dtype.torch).reshape(t.shape), tmp)
        else:
            if ext == ".npy":
                header = _npy_header(_numpy_dtype(out_dtype, out_path), t.shape)
            else:
                if out_dtype.safetensors is None:
                    raise FormatError(f"{out_path}: safetensors has no dtype code for {out_dtype}")
                nbytes = t.numel * out_dtype.itemsize
                header = encode_header({name: HeaderEntry(out_dtype, tuple(t.shape), 0, nbytes)},
                                       {"format": "pt", "state": state})
            with open(tmp, "wb") as f:
                f.write(header)
                _stream(source, t, state, out_dtype, f, window_bytes, progress)
                f.flush()
                os.fsync(f.fileno())
    return {"name": name, "state": state, "shape": list(t.shape), "dtype": out_dtype.name,
            "path": out_path, "bytes": os.path.getsize(out_path)}


def _stream(source: TensorSource, t: TensorMeta, state: str, out_dtype: DType, f,
            window_bytes: int, progress=None) -> None:
    src_dtype = t.states[state].dtype
    per = max(1, window_bytes // max(src_dtype.itemsize, out_dtype.itemsize))
    total = t.numel * src_dtype.itemsize
    with BufferPool(2 * window_bytes + 8192) as pool:
        with pool.acquire(per * src_dtype.itemsize) as sb, \
                pool.acquire(per * out_dtype.itemsize) as ob:
            for lo in range(0, t.numel, per):
                n = min(per, t.numel - lo)
                data = sb.view(src_dtype.torch, n)
                source.read_state(t.name, state, lo, data)
                if out_dtype != src_dtype:
                    out = ob.view(out_dtype.torch, n)
                    out.copy_(data)
                    data = out
                f.write(memoryview(data.view(torch.uint8).numpy()))
                if progress is not None:
                    progress((lo + n) * src_dtype.itemsize, total)


def _npy_header(dtype: np.dtype, shape: tuple) -> bytes:
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_2_0(
        buf, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
              "shape": tuple(shape)})
    return buf.getvalue()
