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
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass, field

from ..dtypes import BY_NAME, DType
from .errors import FormatError


class CheckpointFileError(FormatError):
    """A file that cannot be read as a checkpoint (missing, truncated, corrupt, unsafe).

    The message starts with the file's path and says what is wrong.
    """


class UnsafePickleError(CheckpointFileError):
    """A pickle that names a global outside the allow-list; nothing of it was executed."""


# -- what a tensor becomes ---------------------------------------------------------------

@dataclass(frozen=True)
class StorageRef:
    """A tensor storage record of the archive, never loaded: ``key`` names ``data/<key>``."""

    key: str
    dtype: DType
    numel: int  # elements of ``dtype``


@dataclass(frozen=True)
class TensorRef:
    """A tensor as pickled: a view (offset/shape/stride, in elements) of a ``StorageRef``."""

    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    attrs: dict = field(default_factory=dict, compare=False, hash=False)

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
        return f"<{type(self).qualname} stand-in args={self.args!r} state={self.state!r}>"


def _inert_class(module: str, name: str) -> type:
    return type(name, (Inert,), {"qualname": f"{module}.{name}", "__module__": __name__})


# -- tensor rebuild functions (replacing torch's) ------------------------------------------

def _rebuild_tensor(storage, storage_offset, size, stride, *_rest):
    if not isinstance(storage, StorageRef):
        raise pickle.UnpicklingError(f"tensor rebuilt from {type(storage).__name__}, not a storage record")
    return TensorRef(storage, int(storage_offset), tuple(int(s) for s in size),
                     tuple(int(s) for s in stride))


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, *_rest):
    # v3 carries the dtype separately because the storage is untyped bytes
    if not isinstance(dtype, DType):
        raise pickle.UnpicklingError(f"tensor of dtype {dtype!r}, not a dtype")
    if isinstance(storage, StorageRef) and storage.dtype != dtype:
        storage = StorageRef(storage.key, dtype, storage.numel * storage.dtype.itemsize // dtype.itemsize)
    return _rebuild_tensor(storage, storage_offset, size, stride)


def _rebuild_parameter(data, *_rest):
    return data


def _rebuild_from_type_v2(func, new_type, args, state):
    """Tensor subclasses (and tensors with Python attributes such as DeepSpeed's ``ds_id``):
    rebuild the plain tensor with one of *our* functions, keep the attributes as data."""
    if func not in _REBUILD_FUNCS:
        raise pickle.UnpicklingError(f"_rebuild_from_type_v2 with an unexpected function {func!r}")
    ref = func(*args)
    if isinstance(ref, TensorRef) and isinstance(state, dict) and state:
        ref.attrs.update(state)
    return ref


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


_ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "defaultdict"): collections.defaultdict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): bytearray,
    ("torch", "Size"): tuple,  # torch.Size is a tuple subclass; shapes only need the tuple
    ("torch", "Tensor"): _TypeMarker("torch.Tensor"),
    ("torch", "device"): _inert_class("torch", "device"),
    ("torch.nn.parameter", "Parameter"): _TypeMarker("torch.nn.parameter.Parameter"),
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
}

# Top-level modules whose classes become inert stand-ins: data we may walk past, never run.
_INERT_MODULES = frozenset({"deepspeed", "numpy", "argparse", "megatron"})


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only allow-listed globals and never loads storages.

    Args:
        file: a binary file object holding the pickle.
        source: the path named in errors.
    """

    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source
        self.storages: dict[str, StorageRef] = {}

    def find_class(self, module: str, name: str):
        target = _ALLOWED.get((module, name))
        if target is not None:
            return target
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageMarker(_STORAGE_DTYPES[name])
        if module == "torch" and name in BY_NAME:
            return BY_NAME[name]  # torch.float32 & co. (a dtype outside the table is refused)
        if module.split(".")[0] in _INERT_MODULES:
            return _inert_class(module, name)
        raise UnsafePickleError(
            f"{self.source}: refusing to load: the pickle names the global {module}.{name}, "
            f"which is not on the allow-list (nothing was executed)")

    def persistent_load(self, pid):
        # torch.save's format: ('storage', storage_type, key, location, numel)
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        _, marker, key, _location, numel = pid
        if not isinstance(marker, _StorageMarker):
            raise pickle.UnpicklingError(f"storage of unknown type {marker!r}")
        key = str(key)
        ref = self.storages.get(key)
        if ref is None:
            ref = StorageRef(key, marker.dtype, int(numel))
            self.storages[key] = ref
        return ref


# -- the zip container ----------------------------------------------------------------------

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zip local file header, 30 bytes


@dataclass(frozen=True)
class RecordSpan:
    """Where a record's bytes lie in the file: ``[offset, offset + nbytes)``."""

    name: str
    offset: int
    nbytes: int


class PtArchive:
    """The records of one ``torch.save`` zip file, located without reading their data.

    Only the zip's central directory and, per record, its 30-byte local header are read.
    """

    def __init__(self, path: str):
        self.path = os.fspath(path)
        try:
            with zipfile.ZipFile(self.path) as zf:
                infos = zf.infolist()
        except FileNotFoundError:
            raise CheckpointFileError(f"{self.path}: file not found") from None
        except zipfile.BadZipFile as e:
            raise CheckpointFileError(
                f"{self.path}: not a readable torch checkpoint (truncated or corrupt zip: {e})") from None
        pkl = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
        if len(pkl) != 1:
            raise CheckpointFileError(f"{self.path}: zip holds no single data.pkl; not a torch.save file")
        self.prefix = pkl[0].filename[: -len("data.pkl")]
        self._infos = {i.filename: i for i in infos}
        self._spans: dict[str, RecordSpan] | None = None
        self.size = os.path.getsize(self.path)

    def read_record(self, name: str) -> bytes:
        """The bytes of a small record (data.pkl, byteorder), CRC-checked."""
        info = self._infos.get(self.prefix + name)
        if info is None:
            raise CheckpointFileError(f"{self.path}: record {name!r} missing")
        try:
            with zipfile.ZipFile(self.path) as zf:
                return zf.read(info)
        except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
            raise CheckpointFileError(f"{self.path}: record {name!r} unreadable (truncated or corrupt: {e})") from None

    def storage_spans(self) -> dict[str, RecordSpan]:
        """Every ``data/<key>`` record's byte span, by storage key."""
        if self._spans is None:
            spans = {}
            with open(self.path, "rb") as f:
                for fname, info in self._infos.items():
                    if not fname.startswith(self.prefix + "data/"):
                        continue
                    key = fname[len(self.prefix) + len("data/"):]
                    spans[key] = self._locate(f, info)
            self._spans = spans
        return self._spans

    def record_span(self, key: str) -> RecordSpan:
        span = self.storage_spans().get(key)
        if span is None:
            raise CheckpointFileError(f"{self.path}: storage record data/{key} missing")
        return span

    def _locate(self, f, info: zipfile.ZipInfo) -> RecordSpan:
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointFileError(f"{self.path}: record {info.filename} is compressed; "
                                      f"torch.save never compresses (not a torch checkpoint?)")
        f.seek(info.header_offset)
        raw = f.read(_LOCAL_HEADER.size)
        if len(raw) < _LOCAL_HEADER.size or raw[:4] != b"PK\x03\x04":
            raise CheckpointFileError(f"{self.path}: bad zip local header for {info.filename} "
                                      f"at byte {info.header_offset} (corrupt file)")
        fields = _LOCAL_HEADER.unpack(raw)
        name_len, extra_len = fields[9], fields[10]
        offset = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        if offset + info.file_size > self.size:
            raise CheckpointFileError(
                f"{self.path}: record {info.filename} ends at byte {offset + info.file_size} "
                f"but the file has {self.size} bytes (truncated)")
        return RecordSpan(info.filename, offset, info.file_size)


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
    zip-format torch file, truncated, corrupt, big-endian, or names a forbidden global.
    """
    path = os.fspath(path)
    archive = PtArchive(path)
    order = archive._infos.get(archive.prefix + "byteorder")
    if order is not None and archive.read_record("byteorder").strip() != b"little":
        raise CheckpointFileError(f"{path}: big-endian checkpoints are not supported")
    data = archive.read_record("data.pkl")
    unpickler = RestrictedUnpickler(io.BytesIO(data), path)
    try:
        obj = unpickler.load()
    except UnsafePickleError:
        raise
    except Exception as e:  # any failure of a corrupt pickle: one line naming the file
        raise CheckpointFileError(f"{path}: corrupt pickle in data.pkl ({type(e).__name__}: {e})") from None
    return PtFile(path, obj, archive, unpickler.storages)
