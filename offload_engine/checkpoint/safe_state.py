"""Training state (a scheduler's, a sampler's, RNG states, a user's dict) as strict JSON:
no pickle, so loading a checkpoint can never run code.

What can be stored, and how it comes back:

=========================================  ============================================
value                                      stored as
=========================================  ============================================
None, bool, int, str                       itself
float                                      itself; NaN and +-inf as ``{"__float__": "nan"}``
list                                       a list
tuple                                      ``{"__tuple__": [...]}`` (a tuple again)
dict with str keys                         an object (keys starting ``__`` are escaped)
dict with int/float/bool/None/tuple keys   ``{"__dict__": [[key, value], ...]}``
torch.Tensor (dense, CPU or GPU)           ``{"__tensor__": {"dtype", "shape", "data"}}``
                                           (base64 of its bytes; comes back on the CPU)
numpy ndarray or numpy scalar              ``{"__ndarray__": {...}}`` (same; a scalar too)
=========================================  ============================================

Anything else (a function, a custom object, a DTensor, a sparse tensor) is refused with a
TypeError naming where it sits (``extra['sampler']['order']``): give the object a
``state_dict()`` made of the values above. Tensors are meant to be small (an RNG state, a
sampler's permutation): ``MAX_TENSOR_BYTES`` per rank and save in all.
"""

from __future__ import annotations

import base64
import math

import torch

from .. import dtypes
from ..errors import InputError

MAX_TENSOR_BYTES = 64 * 2**20   # bytes of tensors per rank and save (base64 in JSON)
_MARKERS = ("__float__", "__tuple__", "__dict__", "__tensor__", "__ndarray__", "__str__")


class _Budget:
    def __init__(self):
        self.used = 0

    def take(self, nbytes: int, where: str) -> None:
        self.used += nbytes
        if self.used > MAX_TENSOR_BYTES:
            raise TypeError(f"{where}: tensors of the extra state exceed {MAX_TENSOR_BYTES} bytes "
                            "on this rank; save large tensors as model buffers or parameters")


def encode(value, where: str, budget: _Budget | None = None):
    """``value`` as strict JSON (the table above); TypeError naming ``where`` (a path such
    as ``extra['scheduler']``) and the type for anything that cannot be stored safely."""
    budget = budget or _Budget()
    if value is None or isinstance(value, (bool, str)):
        return value
    np = _numpy()
    if np is not None and isinstance(value, (np.ndarray, np.generic)):  # before float: np.float64 is one
        return {"__ndarray__": _ndarray(np, value, where, budget)}
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]", budget) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, f"{where}[{i}]", budget) for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {_escape(k): encode(v, f"{where}[{k!r}]", budget) for k, v in value.items()}
        return {"__dict__": [[encode(k, f"{where} key {k!r}", budget),
                              encode(v, f"{where}[{k!r}]", budget)] for k, v in value.items()]}
    if isinstance(value, torch.Tensor):
        return {"__tensor__": _tensor(value, where, budget)}
    raise TypeError(f"{where}: a {type(value).__module__}.{type(value).__qualname__} cannot be "
                    "stored safely in a checkpoint (no pickle). Allowed: None, bool, int, float, "
                    "str, list, tuple, dict, torch.Tensor, numpy arrays; give the object a "
                    "state_dict() made of those")


def decode(doc, where: str):
    """The value ``encode`` stored; CheckpointError-worthy problems raise ValueError naming
    ``where`` (the caller adds the file)."""
    if isinstance(doc, list):
        return [decode(v, where) for v in doc]
    if not isinstance(doc, dict):
        return doc
    if len(doc) == 1:
        (key, body), = doc.items()
        if key == "__float__":
            if body not in ("nan", "inf", "-inf"):
                raise InputError(f"{where}: a non-finite float must be nan, inf or -inf, got {body!r}")
            return float(body)
        if key == "__tuple__":
            return tuple(decode(v, where) for v in _list(body, where))
        if key == "__dict__":
            out = {}
            for pair in _list(body, where):
                if not isinstance(pair, list) or len(pair) != 2:
                    raise InputError(f"{where}: a __dict__ item must be [key, value]")
                k = decode(pair[0], where)
                try:
                    out[k] = decode(pair[1], where)
                except TypeError:
                    raise InputError(f"{where}: key {k!r} cannot be a dict key") from None
            return out
        if key == "__tensor__":
            return _untensor(body, where)
        if key == "__ndarray__":
            return _unndarray(body, where)
    return {_unescape(k): decode(v, f"{where}[{k!r}]") for k, v in doc.items()}


# -- pieces -----------------------------------------------------------------------------------
def _escape(key: str) -> str:
    # a user key that looks like a marker gets one more leading "__str__" so that it
    # decodes as the user's key, never as a marker
    return "__str__" + key if key.startswith("__") else key


def _unescape(key: str) -> str:
    return key[len("__str__"):] if key.startswith("__str__") else key


def _list(body, where: str) -> list:
    if not isinstance(body, list):
        raise InputError(f"{where}: expected a list, got {type(body).__name__}")
    return body


def _numpy():
    try:
        import numpy
    except ImportError:  # numpy is optional for torch; without it there are no ndarrays
        return None
    return numpy


def _tensor(t: torch.Tensor, where: str, budget: _Budget) -> dict:
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        raise TypeError(f"{where}: a {type(t).__name__} (a distributed or subclassed tensor) "
                        "cannot be stored in the extra state; save its local part")
    if t.layout != torch.strided:
        raise TypeError(f"{where}: a {t.layout} tensor cannot be stored; make it dense")
    dt = dtypes.dtype(t.dtype)
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    budget.take(flat.numel() * dt.itemsize, where)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return {"dtype": dt.name, "shape": list(t.shape), "data": base64.b64encode(raw).decode()}


def _untensor(body, where: str) -> torch.Tensor:
    dt, shape, raw = _header(body, where)
    n = math.prod(shape)
    if len(raw) != n * dt.itemsize:
        raise InputError(f"{where}: a {dt.name} tensor of shape {shape} needs {n * dt.itemsize} "
                         f"bytes, the checkpoint holds {len(raw)}")
    out = torch.empty(n, dtype=dt.torch)
    if n:
        out.view(torch.uint8).copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    return out.reshape(shape)


def _ndarray(np, a, where: str, budget: _Budget) -> dict:
    arr = np.asarray(a)
    if arr.dtype.kind not in "biuf" or arr.dtype.byteorder == ">":
        raise TypeError(f"{where}: a numpy array of dtype {arr.dtype} cannot be stored "
                        "(numbers only, native byte order)")
    budget.take(arr.nbytes, where)
    return {"dtype": arr.dtype.str, "shape": list(arr.shape), "scalar": isinstance(a, np.generic),
            "data": base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode()}


def _unndarray(body, where: str):
    np = _numpy()
    if np is None:
        raise InputError(f"{where}: holds a numpy array, and numpy is not installed")
    if not isinstance(body, dict) or not isinstance(body.get("dtype"), str):
        raise InputError(f"{where}: an __ndarray__ needs a dtype string")
    try:
        dt = np.dtype(body["dtype"])
    except TypeError:
        raise InputError(f"{where}: unknown numpy dtype {body['dtype']!r}") from None
    if dt.kind not in "biuf":
        raise InputError(f"{where}: numpy dtype {dt} is not a number type")
    shape, raw = _shape_and_bytes(body, where)
    if len(raw) != math.prod(shape) * dt.itemsize:
        raise InputError(f"{where}: a {dt} array of shape {shape} needs "
                         f"{math.prod(shape) * dt.itemsize} bytes, the checkpoint holds {len(raw)}")
    arr = np.frombuffer(raw, dtype=dt).reshape(shape).copy()
    return arr[()] if body.get("scalar") is True else arr


def _header(body, where: str):
    if not isinstance(body, dict):
        raise InputError(f"{where}: a __tensor__ must be an object")
    try:
        dt = dtypes.dtype(body.get("dtype"))
    except (ValueError, TypeError, KeyError):
        raise InputError(f"{where}: unknown tensor dtype {body.get('dtype')!r}") from None
    shape, raw = _shape_and_bytes(body, where)
    return dt, shape, raw


def _shape_and_bytes(body: dict, where: str):
    shape = body.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise InputError(f"{where}: shape must be a list of integers >= 0, got {shape!r}")
    data = body.get("data")
    if not isinstance(data, str) or len(data) > 2 * MAX_TENSOR_BYTES:
        raise InputError(f"{where}: data must be a base64 string of at most "
                         f"{MAX_TENSOR_BYTES} bytes")
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError:
        raise InputError(f"{where}: data is not base64") from None
    return shape, raw
