"""Read the structure of a ``torch.save`` file without running its code or loading its tensors.

A ``.pt`` file written by ``torch.save`` is an uncompressed zip: ``<prefix>/data.pkl`` holds
the pickled object tree, and every tensor storage is a separate record
``<prefix>/data/<key>``. This module unpickles ``data.pkl`` with an allow-list and returns
the tree with every tensor replaced by a ``TensorRef`` (storage key, dtype, offset, shape,
stride; dtypes are ``offload_engine.dtypes`` entries: neither torch nor ml_dtypes is
imported). No storage byte is read here: callers ``pread`` exactly the records and ranges
they need, at the byte offsets ``PtArchive.record_span`` gives. That is how the DeepSpeed
reader guarantees that consolidating (masters only) never reads a byte of the Adam moments
(``exp_avg``, ``exp_avg_sq``), which inspect, diff and export read when asked for.

Security: ``pickle`` executes whatever callable a file names. ``RestrictedUnpickler`` only
resolves globals on an explicit allow-list (containers, torch storage/dtype markers, tensor
rebuild functions, replaced by our own). DeepSpeed, numpy and argparse classes that appear
in checkpoints, and ``torch.device``, are replaced by ``Inert`` stand-ins that record their
arguments and run nothing. Any other global (``os.system``, ``builtins.eval``, ``subprocess.Popen``, a
function of some module...) raises ``UnsafePickleError`` naming the file.

Memory: a file is untrusted input, so what reading it may cost is capped (``pt_limits``,
docs/untrusted-input.md): the zip directory's size is checked before it is parsed, no
record is decompressed, data.pkl is read only up to a size, unpickling runs under a budget
of bytes (``bounded_unpickler``), no allowed callable allocates from an integer it is
given, and every declared tensor and storage size is checked against the record that holds
it before ``load_pt`` returns.
"""

from __future__ import annotations

import collections
import math
import os
import pickle
import reprlib
import types
from dataclasses import dataclass, field
from typing import Mapping

from ..dtypes import BY_NAME, DType
from . import pt_limits as limits
from .bounded_unpickler import BoundedUnpickler
from .pt_archive import CheckpointFileError, PtArchive, RecordSpan  # noqa: F401 (re-exported)


class UnsafePickleError(CheckpointFileError):
    """A pickle that names a global outside the allow-list; nothing of it was executed."""


# -- what a tensor becomes ---------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StorageRef:
    """A tensor storage record of the archive, never loaded: ``key`` names ``data/<key>``."""

    key: str
    dtype: DType
    numel: int  # elements of ``dtype``


# the attributes of a tensor pickled without any (almost all): one shared, read-only mapping,
# not an empty dict per tensor (a ZeRO-3 model file holds one tensor per parameter)
_NO_ATTRS: Mapping = types.MappingProxyType({})


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor as pickled: a view (offset/shape/stride, in elements) of a ``StorageRef``;
    ``attrs``: the Python attributes pickled with it (DeepSpeed's ``ds_id``), read-only."""

    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    attrs: Mapping = field(default_factory=lambda: _NO_ATTRS, compare=False, hash=False)

    @property
    def dtype(self) -> DType:
        return self.storage.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


class Inert:
    """Stand-in for a class we do not trust or need (DeepSpeed's LossScaler, fragment_address,
    ZeroStageEnum, numpy scalars, argparse.Namespace...).

    Calling, building or filling it only records data: ``args`` (constructor arguments),
    ``state`` (what pickle's BUILD passed), ``items`` / ``entries`` (list/dict filling).
    Attribute access falls back to ``state`` when it is a dict, so ``addr.start`` works for
    a pickled dataclass.
    """

    qualname = "Inert"

    def __new__(cls, *args, **kwargs):
        # pickle's NEWOBJ calls __new__ only, REDUCE calls the class: record in both
        self = object.__new__(cls)
        self.args = args
        self.kwargs = kwargs
        self.state = None
        self.items = []
        self.entries = {}
        return self

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    def append(self, item):
        self.items.append(item)

    def extend(self, items):
        self.items.extend(items)

    def __setitem__(self, key, value):
        self.entries[key] = value

    def __getattr__(self, name):
        state = self.__dict__.get("state")
        if isinstance(state, dict) and name in state:
            return state[name]
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict) \
                and name in state[1]:
            return state[1][name]  # (dict_state, slot_state)
        raise AttributeError(f"{type(self).qualname} stand-in has no attribute {name!r}")

    @property
    def value(self):
        """The single constructor argument (an Enum's value), else None."""
        return self.args[0] if len(self.args) == 1 else None

    def __repr__(self):
        # bounded: args may be a pickle's million-item list, repeated through the memo
        return f"<{type(self).qualname} stand-in args={short_repr(self.args)} state={short_repr(self.state)}>"


def short_repr(obj) -> str:
    """A repr of at most a few hundred characters, whatever ``obj`` holds."""
    return reprlib.repr(obj)


def _inert_class(module: str, name: str) -> type:
    return type(name, (Inert,), {"qualname": f"{module}.{name}", "__module__": __name__})


# -- tensor rebuild functions (replacing torch's) ------------------------------------------

def _extent(value, what: str) -> int:
    """``value`` as a size, stride, offset or element count: an int in [0, MAX_EXTENT]."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limits.MAX_EXTENT:
        raise pickle.UnpicklingError(f"tensor {what} {short_repr(value)} is not an integer in "
                                     f"[0, 2**63)")
    return value


def _extents(values, what: str) -> tuple[int, ...]:
    if not isinstance(values, (tuple, list)) or len(values) > limits.MAX_NDIM:
        raise pickle.UnpicklingError(f"tensor {what} {short_repr(values)} is not a tuple of at most "
                                     f"{limits.MAX_NDIM} integers")
    return tuple(_extent(v, what) for v in values)


def _rebuild_tensor(storage, storage_offset, size, stride, *_rest):
    if not isinstance(storage, StorageRef):
        raise pickle.UnpicklingError(f"tensor rebuilt from {type(storage).__name__}, not a storage record")
    offset = _extent(storage_offset, "offset")
    shape = _extents(size, "shape")
    strides = _extents(stride, "stride")
    if len(shape) != len(strides):
        raise pickle.UnpicklingError(f"tensor shape {shape} and stride {strides} differ in length")
    if all(shape):  # a tensor of no elements reads nothing
        last = offset + sum((n - 1) * s for n, s in zip(shape, strides))
        if last >= storage.numel:
            raise pickle.UnpicklingError(
                f"tensor (offset {offset}, shape {shape}, stride {strides}) reaches element "
                f"{last} of storage data/{storage.key}, which has {storage.numel} elements")
    return TensorRef(storage, offset, shape, strides)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, *_rest):
    # v3 carries the dtype separately because the storage is untyped bytes
    if not isinstance(dtype, DType):
        raise pickle.UnpicklingError(f"tensor of dtype {dtype!r}, not a dtype")
    if isinstance(storage, StorageRef) and storage.dtype != dtype:
        storage = StorageRef(storage.key, dtype, storage.numel * storage.dtype.itemsize // dtype.itemsize)
    return _rebuild_tensor(storage, storage_offset, size, stride)


def _rebuild_parameter(data, *_rest):
    return data


_REBUILD_FUNCS = {_rebuild_tensor, _rebuild_tensor_v3, _rebuild_parameter}

# torch.<X>Storage markers as written by torch.save -> element dtype
_STORAGE_DTYPES = {marker: BY_NAME[name] for marker, name in {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "UntypedStorage": "uint8",
    "ComplexFloatStorage": "complex64", "ComplexDoubleStorage": "complex128",
}.items()}


class _TypeMarker:
    """What ``torch.Tensor`` / ``torch.nn.Parameter`` resolve to: they only appear as the
    ``new_type`` argument of ``_rebuild_from_type_v2``, which ignores it. A marker, not the
    class, so a pickle cannot call them (allocate tensors) on its own."""

    def __init__(self, name: str):
        self.name = name


class _StorageMarker:
    """What ``torch.FloatStorage`` and friends resolve to: only their dtype matters."""

    def __init__(self, dtype: DType):
        self.dtype = dtype


# Globals a pickle may name, resolved to what they become. Every callable here is a
# function, never a class (pickle's NEWOBJ calls ``cls.__new__`` directly, which would skip
# the checks), and none allocates from an integer argument: the containers copy only
# objects the pickle already built, and charge the copy to the unpickler's budget first.
_ALLOWED_VALUES = {
    ("torch", "Tensor"): _TypeMarker("torch.Tensor"),
    ("torch.nn.parameter", "Parameter"): _TypeMarker("torch.nn.parameter.Parameter"),
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
}

# Globals resolved to a method of the unpickler (they charge its budget): name -> method.
_ALLOWED_METHODS = {
    ("collections", "OrderedDict"): "_ordered_dict",
    ("collections", "defaultdict"): "_defaultdict",
    ("builtins", "set"): "_set",
    ("builtins", "frozenset"): "_frozenset",
    ("builtins", "slice"): "_slice",
    ("builtins", "complex"): "_complex",
    ("builtins", "bytearray"): "_bytearray",
    ("torch._tensor", "_rebuild_from_type_v2"): "_rebuild_from_type",
    ("torch", "Size"): "_size",  # torch.Size is a tuple subclass; shapes only need the tuple
}

# Top-level modules whose classes become inert stand-ins: data we may walk past, never run.
_INERT_MODULES = frozenset({"deepspeed", "numpy", "argparse", "megatron"})

# Bytes charged per item a container constructor copies (a dict or set entry and its share
# of the hash table; a tuple slot is 8 bytes, charged at the same rate for simplicity).
_ITEM_BYTES = 64
_CLASS_BYTES = 2048  # a stand-in class object and its dict


class RestrictedUnpickler(BoundedUnpickler):
    """Unpickler that resolves only allow-listed globals, never loads storages, and stops
    past ``limits.MAX_UNPICKLE_BYTES`` of objects (see ``BoundedUnpickler``).

    Args:
        data: the pickle (``data.pkl``'s bytes).
        source: the path named in errors.
    """

    # stand-ins record their state; an OrderedDict (always a new one, built by
    # _ordered_dict) carries a state_dict's ``_metadata`` attribute
    BUILD_TYPES = (Inert, collections.OrderedDict)
    MAX_TUPLE_NESTING = limits.MAX_TUPLE_NESTING

    def __init__(self, data: bytes, source: str, budget: int = limits.MAX_UNPICKLE_BYTES):
        super().__init__(data, budget)
        self.source = source
        self.storages: dict[str, StorageRef] = {}
        self._inert: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str):
        target = _ALLOWED_VALUES.get((module, name))
        if target is not None:
            return target
        method = _ALLOWED_METHODS.get((module, name))
        if method is not None:
            return getattr(self, method)
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageMarker(_STORAGE_DTYPES[name])
        if module == "torch" and name in BY_NAME:
            return BY_NAME[name]  # torch.float32 & co. (a dtype outside the table is refused)
        if module.split(".")[0] in _INERT_MODULES or (module, name) == ("torch", "device"):
            return self._inert_class(module, name)
        raise UnsafePickleError(
            f"{self.source}: refusing to load: the pickle names the global {module[:200]}."
            f"{name[:200]}, which is not on the allow-list (nothing was executed)")

    def _inert_class(self, module: str, name: str) -> type:
        cls = self._inert.get((module, name))
        if cls is None:
            if len(self._inert) >= limits.MAX_INERT_CLASSES:
                raise pickle.UnpicklingError(
                    f"the pickle names more than {limits.MAX_INERT_CLASSES} classes")
            self.charge(_CLASS_BYTES + len(module) + len(name))
            cls = self._inert[(module, name)] = _inert_class(module, name)
        return cls

    def persistent_load(self, pid):
        # torch.save's format: ('storage', storage_type, key, location, numel)
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {short_repr(pid)}")
        _, marker, key, _location, numel = pid
        if not isinstance(marker, _StorageMarker):
            raise pickle.UnpicklingError(f"storage of unknown type {short_repr(marker)}")
        if not isinstance(key, str) or len(key) > limits.MAX_STORAGE_KEY:
            raise pickle.UnpicklingError(f"storage key {short_repr(key)} is not a short string")
        numel = _extent(numel, "storage size")
        ref = self.storages.get(key)
        if ref is None:
            ref = StorageRef(key, marker.dtype, numel)
            self.storages[key] = ref
        return ref

    # -- allow-listed callables: copies of objects the pickle built, charged first -----------

    def _sized(self, items, what: str, per_item: int = _ITEM_BYTES):
        if not isinstance(items, (list, tuple, set, frozenset, dict, str, bytes)):
            raise pickle.UnpicklingError(f"{what} of a {type(items).__name__}")
        self.charge(per_item * len(items))
        return items

    def _set(self, items=()):
        return set(self._sized(items, "set"))

    def _frozenset(self, items=()):
        return frozenset(self._sized(items, "frozenset"))

    def _ordered_dict(self, items=()):
        return collections.OrderedDict(self._sized(items, "OrderedDict"))

    def _defaultdict(self, factory=None, items=()):
        # reading never inserts a missing key, so the factory (whatever it is) is dropped
        return collections.defaultdict(None, self._sized(items, "defaultdict"))

    def _slice(self, *args):
        return slice(*args)

    def _complex(self, real=0, imag=0):
        for part in (real, imag):
            if not isinstance(part, (int, float, str)) or isinstance(part, str) and len(part) > 100:
                raise pickle.UnpicklingError(f"complex of {short_repr(part)}")
        return complex(real, imag)

    def _bytearray(self, source=b"", encoding=None):
        # pickle protocol 2 writes bytearray(str, "latin-1"); never bytearray(int), which
        # would allocate as many bytes as the integer says
        if not isinstance(source, (bytes, bytearray, str)):
            raise pickle.UnpicklingError(f"bytearray of a {type(source).__name__}, not of bytes")
        self.charge(4 * len(source))
        return bytearray(source, encoding) if isinstance(source, str) else bytearray(source)

    def _size(self, dims=()):
        return _extents(dims, "shape")

    def _rebuild_from_type(self, func, new_type, args, state):
        """Tensor subclasses (and tensors with Python attributes such as DeepSpeed's
        ``ds_id``): rebuild the plain tensor with one of *our* functions, keep the
        attributes as data."""
        if func not in _REBUILD_FUNCS:
            raise pickle.UnpicklingError(f"_rebuild_from_type_v2 with an unexpected function {short_repr(func)}")
        if not isinstance(args, tuple):
            raise pickle.UnpicklingError(f"_rebuild_from_type_v2 with arguments {short_repr(args)}")
        ref = func(*args)
        if isinstance(ref, TensorRef) and isinstance(state, dict) and state:
            self.charge(_ITEM_BYTES * len(state))
            ref = TensorRef(ref.storage, ref.offset, ref.shape, ref.stride, dict(state))
        return ref


@dataclass
class PtFile:
    """A ``torch.save`` file opened for lazy reading: the object tree and its archive."""

    path: str
    obj: object
    archive: PtArchive
    storages: dict[str, StorageRef]

    def tensor_span(self, ref: TensorRef) -> tuple[int, int]:
        """(file byte offset, bytes) of a contiguous tensor's data."""
        if not ref.is_contiguous():
            raise CheckpointFileError(f"{self.path}: non-contiguous tensor (shape {ref.shape}, "
                                      f"stride {ref.stride}) is not supported")
        itemsize = ref.dtype.itemsize
        span = self.archive.record_span(ref.storage.key)
        start = ref.offset * itemsize
        nbytes = ref.numel * itemsize
        if start + nbytes > span.nbytes:
            raise CheckpointFileError(f"{self.path}: tensor reaches past its storage record "
                                      f"data/{ref.storage.key} (corrupt file)")
        return span.offset + start, nbytes


def load_pt(path: str | os.PathLike) -> PtFile:
    """Unpickle a ``torch.save`` file's structure safely; tensors become ``TensorRef``.

    Raises CheckpointFileError (a ValueError) naming the file when it is missing, not a
    zip-format torch file, truncated, corrupt, big-endian, names a forbidden global,
    or exceeds a cap of ``pt_limits`` (docs/untrusted-input.md).
    """
    path = os.fspath(path)
    archive = PtArchive(path)
    order = archive._infos.get(archive.prefix + "byteorder")
    if order is not None and archive.read_record("byteorder").strip() != b"little":
        raise CheckpointFileError(f"{path}: big-endian checkpoints are not supported")
    data = archive.read_record("data.pkl", limits.MAX_PICKLE_BYTES)
    unpickler = RestrictedUnpickler(data, path)
    try:
        obj = unpickler.load()
    except UnsafePickleError:
        raise
    except Exception as e:  # any failure of a corrupt pickle: one line naming the file
        raise CheckpointFileError(f"{path}: corrupt pickle in data.pkl "
                                  f"({type(e).__name__}: {str(e)[:300]})") from None
    del data, unpickler.memo  # the memo may hold the only references to big unused objects
    for ref in unpickler.storages.values():
        span = archive.record_span(ref.key)
        if ref.numel * ref.dtype.itemsize > span.nbytes:
            raise CheckpointFileError(
                f"{path}: storage data/{ref.key} declares {ref.numel} elements of "
                f"{ref.dtype.name} ({ref.numel * ref.dtype.itemsize} bytes) but its record has "
                f"{span.nbytes} bytes (corrupt file)")
    return PtFile(path, obj, archive, unpickler.storages)
