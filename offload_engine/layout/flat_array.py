"""FlatArray: a 1-D zarr v3 array whose chunk files the engine reads and writes itself.

Element ranges map to byte ranges of chunk files ``<path>/c/<i>``; each piece goes to
``AsyncFileIO`` as one request, so the hot path is preadv/pwritev into the caller's buffer
with no zarr-python in between. Chunk files are either absent (every element equals the
fill value; nothing is read, the fill is written into the caller's buffer) or exactly
``chunk_bytes`` long, the edge chunk padded as the zarr spec requires.

Arrays written by other tools are served directly when their chunks are plain
little-endian bytes. Compressed, sharded or big-endian 1-D arrays are read through
zarr-python (slow, correct) and refused for writing; anything else is refused at open.

Neither torch nor zarr-python is imported here: buffers may be tensors (torch is then
already imported by whoever made them), numpy arrays or any writable buffer; ``read``,
which returns a new tensor, imports torch, and the slow path imports zarr-python.
"""

from __future__ import annotations

import errno
import os
import re
import sys
import threading
from typing import Iterable

import numpy as np

from .. import dtypes
from ..dtypes import DType
from ..io import AsyncFileIO, FileIOError, IOFuture, PooledBuffer, TruncatedFileError, syscalls
from ..io.align import as_byte_view
from ..units import PAGE, MiB
from .fill_values import bytes_to_scalar, fill_pattern
from .metadata import (ArrayMetadata, ForeignArrayError, MetadataError, NodeNotFoundError,
                       fsync_dir, metadata_path, new_array_doc, parse_array, json_attributes,
                       read_node, write_json_atomic)
from ..errors import InputError, PathExistsError

DEFAULT_CHUNK_BYTES = 64 * MiB


def chunk_bytes_for(numel: int, itemsize: int, chunk_bytes: int) -> int:
    """Bytes of every chunk file of an array of ``numel`` elements of ``itemsize`` bytes
    asked to have ``chunk_bytes``-byte chunks: never more than the array's size rounded up
    to a page (at least one), since edge chunks are stored at full size and a 10-element
    array should not cost a 64 MiB file."""
    return min(chunk_bytes, -(-max(numel * itemsize, 1) // PAGE) * PAGE)


class ChunkSizeError(FileIOError):
    """A chunk file whose size is not the array's chunk size (bytes); names the file."""


class TruncatedChunkError(ChunkSizeError, TruncatedFileError):
    """A chunk file shorter than the array's chunk size: a torn or truncated write."""


class FlatArray:
    """A 1-D zarr v3 array of ``numel`` elements, read and written by element range.

    Create with :meth:`create`, open with :meth:`open`. Methods that move data return an
    ``IOFuture`` (result: bytes delivered, fill included); argument errors are raised at
    the call. Two FlatArray objects on one path in one process must not create chunks
    concurrently; reads and writes of the same range must not overlap in time.
    """

    def __init__(self, meta: ArrayMetadata, io: AsyncFileIO, mode: str):
        self._meta = meta
        self._io = io
        self._mode = mode
        self._create_lock = threading.Lock()  # stat-then-create of a chunk is one step
        self._zarr_array = None  # opened on first slow-path read
        # chunk indices known to have a full-size file, when the owner declared them
        # (``track_chunks``); None: ask the file system at each access
        self._present: set[int] | None = None

    # -- construction --------------------------------------------------------------------------
    @staticmethod
    def dimension_for(name: str) -> str:
        """The dimension name of the array called ``name`` in its group ("rank0/param" ->
        "rank0_param_element"): one per array, so xarray, which aligns variables that
        share a dimension name, opens a group whose arrays differ in length."""
        return re.sub(r"[^A-Za-z0-9_]", "_", name) + "_element"

    @classmethod
    def create(cls, path: str | os.PathLike, numel: int, dtype, *,
               io: AsyncFileIO, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               attributes: dict | None = None, dimension_name: str = "element",
               preallocate: bool = False, overwrite: bool = False) -> "FlatArray":
        """Create the array directory and its zarr.json; returns the array opened "r+".

        Args:
            numel: elements in the array.
            dtype: element type: a torch or numpy dtype, a name or an
                ``offload_engine.dtypes.DType`` (float32, bfloat16, float16, float64, the
                integer types and bool).
            chunk_bytes: bytes per chunk file, a positive multiple of 4096. It is capped at
                the array's size rounded up to 4096, so a small array is one small file
                (read ``.chunk_bytes`` for the value in use).
            attributes: JSON-serialisable dict stored in zarr.json ``attributes``.
            dimension_name: the single entry of ``dimension_names``.
            preallocate: reserve every chunk file now (posix_fallocate); otherwise each is
                created, at full size, by the first write that touches it.
            overwrite: replace an existing array at ``path`` (its chunk files are deleted).

        Chunk files never hold fill values written by Python: an absent file reads as the
        fill value (0) and a preallocated one reads as zeros.
        """
        path = os.fspath(path)
        element = dtypes.dtype(dtype)
        if not element.zarr:
            raise InputError(f"array {path}: dtype {element} cannot be stored in a zarr v3 "
                             f"array here; supported: {', '.join(dtypes.ZARR_NAMES)}")
        numel = _count(numel, "numel", path)
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) \
                or chunk_bytes <= 0 or chunk_bytes % PAGE:
            raise InputError(f"array {path}: chunk_bytes must be a positive multiple of "
                             f"{PAGE} bytes, got {chunk_bytes!r}")
        chunk_bytes = chunk_bytes_for(numel, element.itemsize, chunk_bytes)
        attributes = json_attributes(attributes or {}, f"array {path}")
        if not isinstance(dimension_name, str) or not dimension_name:
            raise InputError(f"array {path}: dimension_name must be a non-empty string, "
                             f"got {dimension_name!r}")
        made = _prepare_directory(path, io, overwrite)
        doc = new_array_doc(numel, element, chunk_bytes // element.itemsize, attributes,
                            dimension_name)
        try:
            _makedirs(os.path.join(path, "c"))
            write_json_atomic(metadata_path(path), doc)
            fsync_dir(os.path.dirname(os.path.abspath(path)))
            array = cls(parse_array(path, doc), io, "r+")
            if preallocate:
                for i in range(array.nchunks):
                    io.preallocate(array.chunk_path(i), array.chunk_bytes)
        except BaseException:
            # a failed create (a full disk) leaves nothing behind, so that it can be retried
            _undo_create(path, io, made)
            raise
        return array

    @classmethod
    def open(cls, path: str | os.PathLike, *, io: AsyncFileIO, mode: str = "r",
             metadata_crc32c: int | None = None) -> "FlatArray":
        """Open an existing array; ``mode`` is "r" (read only) or "r+" (read and write).
        ``metadata_crc32c``: the checksum a checkpoint manifest records for the array's
        zarr.json, checked against its bytes before they are parsed.

        Raises NodeNotFoundError when there is no array at ``path``, ChecksumError or
        MetadataError for a corrupt zarr.json (naming it), ForeignArrayError for arrays the
        engine cannot serve.
        """
        if mode not in ("r", "r+"):
            raise InputError(f"mode must be 'r' or 'r+', got {mode!r}")
        path = os.fspath(path)
        return cls(parse_array(path, read_node(path, "array", metadata_crc32c)), io, mode)

    # -- properties ----------------------------------------------------------------------------
    @property
    def path(self) -> str:
        return self._meta.path

    @property
    def numel(self) -> int:
        """Elements in the array."""
        return self._meta.numel

    @property
    def element(self) -> DType:
        """The element type (``offload_engine.dtypes``; no torch needed)."""
        return self._meta.element

    @property
    def dtype(self):
        """The element type as a torch dtype (imports torch)."""
        return self._meta.element.torch

    @property
    def zarr_dtype(self) -> str:
        """The zarr v3 ``data_type`` name."""
        return self._meta.element.name

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self._meta.element.itemsize

    @property
    def chunk_elems(self) -> int:
        """Elements per chunk file."""
        return self._meta.chunk_elems

    @property
    def chunk_bytes(self) -> int:
        """Bytes per chunk file (every chunk file, the edge chunk included)."""
        return self._meta.chunk_elems * self.itemsize

    @property
    def nchunks(self) -> int:
        return -(-self.numel // self.chunk_elems)

    @property
    def fill_bytes(self) -> bytes:
        """One element equal to the fill value, as its little-endian bytes."""
        return self._meta.fill_bytes

    @property
    def fill_value(self):
        """The value of never-written elements, as a Python bool, int or float."""
        return bytes_to_scalar(self._meta.element, self._meta.fill_bytes)

    @property
    def attributes(self) -> dict:
        """A copy of zarr.json ``attributes``."""
        return dict(self._meta.attributes)

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def direct(self) -> bool:
        """True when the engine moves chunk bytes itself; False: zarr-python reads, no writes."""
        return self._meta.direct_problem is None

    @property
    def foreign_problem(self) -> str | None:
        """Why the engine does not move this array's bytes itself (None when it does)."""
        return self._meta.direct_problem

    def chunk_path(self, i: int) -> str:
        """File of chunk ``i`` (0 <= i < nchunks), e.g. ``<path>/c/3``."""
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.nchunks:
            raise InputError(f"array {self.path}: chunk index {i!r} outside [0, {self.nchunks})")
        return os.path.join(self.path, self._meta.chunk_key(i))

    def _chunk_dir(self) -> str:
        return os.path.dirname(os.path.join(self.path, self._meta.chunk_key(0)))

    def __repr__(self) -> str:
        return (f"FlatArray({self.path!r}, numel={self.numel}, dtype={self.dtype}, "
                f"chunk_bytes={self.chunk_bytes}, mode={self._mode!r})")

    # -- reads ---------------------------------------------------------------------------------
    def read_into(self, start: int, stop: int, out) -> IOFuture:
        """Read elements [start, stop) into ``out``.

        ``out``: a contiguous CPU tensor of the array's dtype with >= stop-start elements,
        a PooledBuffer, or any writable buffer of >= (stop-start)*itemsize bytes; the
        elements land at its start. Missing chunk files are filled with the fill value
        here, without I/O. Raises ValueError for bad ranges or buffers and
        TruncatedChunkError / ChunkSizeError for a chunk file of the wrong size; I/O errors
        arrive through the future.
        """
        start, stop = self._check_range(start, stop)
        nbytes = (stop - start) * self.itemsize
        view = self._buffer_view(out, nbytes, "out", writable=True)
        if nbytes == 0:
            return IOFuture.completed(0)
        if not self.direct:
            return self._slow_read(start, stop, view)
        plan = [(span, self.chunk_state(span[0], "read")) for span in self._spans(start, stop)]
        futures = []
        for (chunk, chunk_off, buf_off, length), present in plan:
            piece = view[buf_off:buf_off + length]
            if present:
                futures.append(self._io.read(self.chunk_path(chunk), chunk_off, piece))
            else:
                fill_pattern(piece, self._meta.fill_bytes)
                futures.append(IOFuture.completed(length))
        return IOFuture.gather(futures)

    def read(self, start: int = 0, stop: int | None = None):
        """Elements [start, stop) (default: all) as a new CPU tensor; waits for the I/O.
        Imports torch."""
        import torch

        stop = self.numel if stop is None else stop
        start, stop = self._check_range(start, stop)
        out = torch.empty(stop - start, dtype=self.dtype)
        self.read_into(start, stop, out).result()
        return out

    # -- writes --------------------------------------------------------------------------------
    def write_from(self, start: int, stop: int, src, *, sync: bool = False) -> IOFuture:
        """Write elements [start, stop) from ``src`` (a CPU tensor of the array's dtype, a
        PooledBuffer or any buffer of >= (stop-start)*itemsize bytes, read from its start).

        Chunk files not yet present are created at full size first (preallocated, so the
        untouched rest reads as zeros; for a foreign array with a non-zero fill value, the
        fill is written). With ``sync`` the future completes after every touched chunk file
        (and the chunk directory, when a file was created) is fdatasync'ed.
        """
        self._check_writable()
        start, stop = self._check_range(start, stop)
        nbytes = (stop - start) * self.itemsize
        view = self._buffer_view(src, nbytes, "src", writable=False)
        if nbytes == 0:
            return IOFuture.completed(0)
        spans = list(self._spans(start, stop))
        created = False
        for chunk, *_ in spans:
            created |= self._ensure_chunk(chunk)
        if created and sync:
            fsync_dir(self._chunk_dir())
        return IOFuture.gather([
            self._io.write(self.chunk_path(chunk), chunk_off, view[buf_off:buf_off + length],
                           sync=sync)
            for chunk, chunk_off, buf_off, length in spans])

    def write(self, start: int, tensor, *, sync: bool = False) -> None:
        """Write ``tensor`` (a torch tensor, flattened) at element ``start``; waits for the I/O."""
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(tensor, torch.Tensor):
            raise InputError(f"array {self.path}: write() takes a tensor, got {type(tensor).__name__}")
        flat = tensor.detach().reshape(-1)
        if flat.device.type != "cpu":
            flat = flat.cpu()
        self.write_from(start, start + flat.numel(), flat.contiguous(), sync=sync).result()

    def sync(self) -> IOFuture:
        """fdatasync every chunk file present (and the chunk directory): makes writes durable."""
        futures = [self._io.sync(p) for p in map(self.chunk_path, range(self.nchunks))
                   if os.path.exists(p)]
        if os.path.isdir(self._chunk_dir()):
            fsync_dir(self._chunk_dir())
        return IOFuture.gather(futures)

    def update_attributes(self, attributes: dict) -> None:
        """Merge ``attributes`` into zarr.json ``attributes`` (like dict.update) and rewrite
        zarr.json atomically (temp file, fsync, rename); every other field is kept as is."""
        if self._mode != "r+":
            raise InputError(f"array {self.path} is open read-only (mode 'r'); "
                             f"open it with mode='r+' to update attributes")
        doc = dict(self._meta.doc)
        doc["attributes"] = {**self._meta.attributes,
                             **json_attributes(attributes, f"array {self.path}")}
        write_json_atomic(self._meta.file, doc)
        self._meta.doc = doc

    # -- internals -----------------------------------------------------------------------------
    def _check_range(self, start, stop) -> tuple[int, int]:
        start = _count(start, "start", self.path)
        stop = _count(stop, "stop", self.path)
        if not start <= stop <= self.numel:
            raise InputError(f"array {self.path}: element range [{start}, {stop}) is not "
                             f"within [0, {self.numel}]")
        return start, stop

    def _check_writable(self) -> None:
        if self._mode != "r+":
            raise InputError(f"array {self.path} is open read-only (mode 'r'); "
                             f"open it with mode='r+' to write")
        if not self.direct:
            raise ForeignArrayError(f"array {self.path}: cannot write: "
                                    f"{self._meta.direct_problem}")

    def _buffer_view(self, buf, nbytes: int, role: str, writable: bool) -> memoryview:
        """A flat byte view of the first ``nbytes`` bytes of ``buf``, validated."""
        where = f"array {self.path}: {role}"
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(buf, torch.Tensor):
            if dtypes.lookup(buf.dtype) != self.element:
                raise InputError(f"{where} has dtype {buf.dtype}, the array holds "
                                 f"{self.element}")
            if buf.device.type != "cpu":
                raise InputError(f"{where} is on {buf.device}; file I/O needs a CPU tensor")
            if not buf.is_contiguous():
                raise InputError(f"{where} is not contiguous")
            if buf.numel() * self.itemsize < nbytes:
                raise InputError(f"{where} has {buf.numel()} elements; the range needs "
                                 f"{nbytes // self.itemsize}")
            view = as_byte_view(buf)
        elif isinstance(buf, np.ndarray):
            # raw bytes (uint8), or elements of the array's own type (a bfloat16 array of
            # ml_dtypes included: numpy cannot export it through the buffer protocol)
            if buf.dtype != np.uint8 and dtypes.lookup(buf.dtype) != self.element:
                raise InputError(f"{where} has dtype {buf.dtype}, the array holds "
                                 f"{self.element}")
            if not buf.flags.c_contiguous:
                raise InputError(f"{where} is not contiguous")
            view = as_byte_view(buf)
            if len(view) < nbytes:
                raise InputError(f"{where} holds {len(view)} bytes; the range needs {nbytes}")
        elif isinstance(buf, PooledBuffer):
            if buf.nbytes < nbytes:
                raise InputError(f"{where} is a pooled buffer of {buf.nbytes} bytes; the range "
                                 f"needs {nbytes}")
            view = buf.memoryview(nbytes)
        else:
            try:
                view = memoryview(buf)
            except TypeError:
                raise InputError(f"{where} must be a tensor, a PooledBuffer or a buffer, got "
                                 f"{type(buf).__name__}") from None
            if not view.c_contiguous:
                raise InputError(f"{where} is not a contiguous buffer")
            view = view.cast("B") if (view.format, view.ndim) != ("B", 1) else view
            if len(view) < nbytes:
                raise InputError(f"{where} holds {len(view)} bytes; the range needs {nbytes}")
        if writable and view.readonly:
            raise InputError(f"{where} is read-only")
        return view[:nbytes]

    def _spans(self, start: int, stop: int):
        """(chunk index, byte offset in chunk, byte offset in buffer, bytes) per chunk touched."""
        ce, size = self.chunk_elems, self.itemsize
        pos = start
        while pos < stop:
            chunk = pos // ce
            end = min((chunk + 1) * ce, stop)
            yield chunk, (pos - chunk * ce) * size, (pos - start) * size, (end - pos) * size
            pos = end

    def track_chunks(self, present: Iterable[int]) -> None:
        """Declare which chunk files exist (full size), so that reads and writes trust this
        record instead of asking the file system at every access; chunks this object
        creates are added. For an owner that is the array's only writer (the store, which
        knows its buckets' chunks): a file changed behind its back then surfaces as an I/O
        error of the read itself (a short file is a TruncatedFileError naming it)."""
        self._present = {int(i) for i in present}

    def chunk_state(self, chunk: int, op: str = "read") -> bool:
        """True if chunk ``chunk`` has its file, False if absent (it reads as the fill value);
        a file of the wrong size is an error naming it (TruncatedChunkError when short,
        ChunkSizeError when long; ``op`` words it)."""
        if self._present is not None:
            return chunk in self._present
        path = self.chunk_path(chunk)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            return False
        except OSError as e:
            raise FileIOError(e.errno, "stat", path) from e
        if size < self.chunk_bytes:
            raise TruncatedChunkError(
                errno.ENODATA, op, path, 0, self.chunk_bytes,
                detail=f"truncated chunk: the file has {size} bytes, every chunk of array "
                       f"{self.path} has {self.chunk_bytes}")
        if size > self.chunk_bytes:
            raise ChunkSizeError(
                errno.EINVAL, op, path, 0, self.chunk_bytes,
                detail=f"chunk file has {size} bytes, more than the {self.chunk_bytes} of "
                       f"every chunk of array {self.path}")
        return True

    def _ensure_chunk(self, chunk: int) -> bool:
        """Create chunk ``chunk`` at full size if absent; True when it was created."""
        with self._create_lock:
            if self.chunk_state(chunk, "write"):
                return False
            path = self.chunk_path(chunk)
            _makedirs(os.path.dirname(path))
            try:
                self._io.preallocate(path, self.chunk_bytes)
                if any(self._meta.fill_bytes):
                    # Only foreign arrays have a non-zero fill; the untouched rest of the
                    # chunk must read as that fill, not as preallocated zeros.
                    pattern = bytearray(self.chunk_bytes)
                    fill_pattern(memoryview(pattern), self._meta.fill_bytes)
                    self._io.write(path, 0, pattern).result()
            except BaseException:
                # The chunk was absent and must stay so: a short file left by a failed
                # fallocate would read as a truncated chunk (or, tracked, as present).
                self._remove_new_chunk(path)
                raise
            if self._present is not None:
                self._present.add(chunk)
            return True

    def _remove_new_chunk(self, path: str) -> None:
        """Remove the file a failed ``_ensure_chunk`` created at ``path`` (a striped chunk's
        link stays; its target goes), after closing cached descriptors of it, which would
        otherwise go on writing to the removed file."""
        self._io.forget(path)
        try:
            syscalls.unlink(os.path.realpath(path))
        except FileNotFoundError:
            pass
        except OSError:
            pass  # best effort; the error that matters is the one being raised

    def _slow_read(self, start: int, stop: int, view: memoryview) -> IOFuture:
        """Read through zarr-python (compressed, sharded, big-endian arrays)."""
        future = IOFuture()
        future.set_running_or_notify_cancel()
        try:
            if self._zarr_array is None:
                import zarr

                self._zarr_array = zarr.open_array(self.path, mode="r")
            data = np.asarray(self._zarr_array[start:stop])
            expected = self._meta.element.numpy
            if data.dtype != expected:
                if data.dtype.newbyteorder("=") != expected.newbyteorder("="):
                    raise ForeignArrayError(f"array {self.path}: zarr-python returned {data.dtype}"
                                            f", expected {expected}")
                data = data.astype(expected)  # byte-swap big-endian data
            np.frombuffer(view, dtype=np.uint8)[:] = np.ascontiguousarray(data).view(np.uint8)
            future.set_result(len(view))
        except ForeignArrayError as e:
            future.set_exception(e)
        except Exception as e:  # zarr-python could not decode it: refuse, never guess
            err = ForeignArrayError(f"array {self.path}: {self._meta.direct_problem}, and "
                                    f"zarr-python could not read it either: {e}")
            err.__cause__ = e
            future.set_exception(err)
        return future


def _count(value, name: str, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InputError(f"array {path}: {name} must be a non-negative integer, got {value!r}")
    return int(value)


def _makedirs(path: str) -> None:
    try:
        syscalls.makedirs(path, exist_ok=True)
    except OSError as e:
        raise FileIOError(e.errno, "mkdir", path) from e


def _undo_create(path: str, io: AsyncFileIO, made: bool) -> None:
    """Best effort: remove what a failed ``FlatArray.create`` made at ``path`` (the whole
    directory if it made it, else its zarr.json and chunk folder)."""
    chunks = os.path.join(path, "c")
    if os.path.isdir(chunks):
        for name in os.listdir(chunks):
            io.forget(os.path.join(chunks, name))
    for remove, target in ([(syscalls.rmtree, path)] if made else
                           [(syscalls.rmtree, chunks), (syscalls.unlink, metadata_path(path))]):
        try:
            remove(target)
        except OSError:
            pass  # the error that matters is the one being raised


def _prepare_directory(path: str, io: AsyncFileIO, overwrite: bool) -> bool:
    """Make ``path`` ready for a new array: absent or empty, or (overwrite) an old array
    removed. Returns whether it made the directory."""
    if not os.path.exists(path):
        _makedirs(path)
        return True
    if not os.path.isdir(path):
        raise PathExistsError(f"cannot create array at {path}: a file is in the way")
    if os.path.exists(metadata_path(path)):
        if not overwrite:
            raise PathExistsError(f"cannot create array at {path}: a zarr node is already "
                                  f"there (pass overwrite=True to replace an array)")
        try:
            old = FlatArray.open(path, io=io)
            old_chunks = [old.chunk_path(i) for i in range(old.nchunks)]
        except (MetadataError, ForeignArrayError) as e:
            raise PathExistsError(f"cannot overwrite {path}: it is not an array the engine "
                                  f"can replace ({e})") from None
        for chunk in old_chunks:
            io.forget(chunk)  # a cached descriptor would keep writing to the deleted file
        try:
            syscalls.rmtree(path)
        except OSError as e:
            raise FileIOError(e.errno, "remove", path,
                              detail=f"{e.strerror} (removing the array to overwrite)") from e
        _makedirs(path)
        return True
    if os.listdir(path):
        raise PathExistsError(f"cannot create array at {path}: the directory is not empty "
                              f"and holds no zarr.json")
    return False


__all__ = ["ChunkSizeError", "DEFAULT_CHUNK_BYTES", "FlatArray", "ForeignArrayError",
           "NodeNotFoundError", "TruncatedChunkError"]
