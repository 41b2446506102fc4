"""Stream a checkpoint's tensors into Hugging Face sharded safetensors with bounded memory.

The consolidator only knows the ``formats.TensorSource`` interface: names, shapes, dtypes,
tied aliases, and ranged reads of a tensor's elements. Every format reader is one (our
checkpoints, DeepSpeed ZeRO-1/2/3, safetensors); each tensor's ``value_state()`` is written
(DeepSpeed's fp32 masters, else the parameter).

Data flow: the whole output (headers, offsets, file sizes) is planned from metadata first
(``hf_shards``). Each file is then cut into windows of ``window_bytes``, starting
at byte 0 (the first window carries the header); a window never spans two files, and a
large tensor spans several windows. A reader thread fills window k+1 (source reads, then
the dtype cast) while the main thread writes window k at its offset into the preallocated
file. Windows start at multiples of ``window_bytes`` (a multiple of 4096), so a window is
written with O_DIRECT where the file system allows it, straight from the pool buffer: no
copy into the page cache, no gigabytes of dirty pages left for the final fsync. Buffers
come from one ``BufferPool`` of ``depth + 3`` window slots (``depth`` queued, one being
filled, two being written) and one more where a tensor is cast (its staging), every
buffer holding a whole slot however short its window (so slots never fragment), and the
pages a window can use of each slot are touched before the first read: peak memory is the
pool plus the interpreter, whatever the model's size, its tensor sizes and the disk's
speed. Files are written into a staging folder inside the output folder, synced, and
swapped in by ``publish`` (one commit point: a failed or killed run leaves the earlier
export or the new one, whole), one run at a time per output folder (``OutputLock``).

No torch and no ml_dtypes: windows are raw numpy views of the pool's memory and dtypes are
``offload_engine.dtypes`` entries. Torch is imported only for a cast numpy cannot do bit for
bit as torch does (``--dtype bf16`` from fp32 masters rounds; ``casts``) and by
``verify_output``: its start-up takes longer than consolidating a 267M-parameter checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import queue
import shutil
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from ..dtypes import FLOAT32, DType, dtype as as_dtype
from ..formats.safetensors import INDEX_FILE
from ..formats.source import ReadRequest, TensorMeta, TensorSource
from ..io import ALIGN, AsyncFileIO, BufferPool, IOFuture, PooledBuffer, probe_direct, round_up, syscalls
from ..layout.metadata import fsync_dir
from ..units import MiB
from .casts import as_torch_view, cast_into
from .hf_shards import SINGLE_FILE, OutTensor, ShardPlan, plan_files
from .out_lock import OutputLock
from .publish import publish
from ..errors import InputError

OUTPUT_DTYPES = ("fp32", "bf16", "fp16")  # what float tensors may be written as (dtypes names)


@dataclass(frozen=True, slots=True)
class Written:
    """A tensor as consolidate reads it: the state it writes and that state's dtype."""

    name: str
    shape: tuple[int, ...]
    state: str
    dtype: DType          # of the stored elements of ``state``

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def written_tensors(source: TensorSource, exclude_frozen: bool = False) -> list[Written]:
    """What consolidate writes of ``source``, in its key order: each tensor's value state
    (``TensorMeta.value_state``), frozen parameters left out with ``exclude_frozen``."""
    out = []
    for t in source.tensors():
        if exclude_frozen and t.kind == "frozen":
            continue
        state = t.value_state()
        out.append(Written(t.name, tuple(t.shape), state, t.states[state].dtype))
    return out


def written_aliases(source: TensorSource, exclude_frozen: bool = False) -> dict[str, str]:
    """The tied names consolidate records: the source's, but for those whose owner is a
    frozen parameter left out with ``exclude_frozen``."""
    dropped = {t.name for t in source.tensors() if exclude_frozen and t.kind == "frozen"}
    return {a: o for a, o in source.aliases().items() if o not in dropped}


def output_dtype(info, requested) -> DType:
    """The dtype a tensor is written in: float tensors are cast to ``requested`` (round to
    nearest even when narrowing), everything else keeps its dtype, bit for bit (an int64
    buffer of 16777217 never passes through float32). With fp32, the default, this is
    what DeepSpeed 0.19.8's zero_to_fp32 writes. ``info`` has a ``dtype``."""
    return as_dtype(requested) if info.dtype.is_float else info.dtype


# -- windows ----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class WindowPiece:
    """Elements ``[start, start + count)`` of tensor ``info``, at byte ``out_offset`` of a window."""

    info: Written
    out_dtype: DType
    start: int
    count: int
    out_offset: int


@dataclass
class Window:
    """Bytes ``[file_offset, file_offset + nbytes)`` of file ``path``, built from ``chunks``
    (and, for a file's first window, ``header`` at its start)."""

    path: str
    file_offset: int
    nbytes: int = 0
    stage_bytes: int = 0
    pieces: list[WindowPiece] = field(default_factory=list)
    header: bytes = b""  # bytes of the file's header at the start of the window


# Most tensor pieces in one window. Each piece costs a few Python objects on its way to the
# reader (a request, the reads of its shards, their buffer views: about 1 KB), so a 64 MiB
# window of 1 KB expert tensors would hold 65,536 of them, several windows at once; with
# this cap a window of small tensors ends early (on a 4096-byte boundary) instead, and
# memory stays flat in the number of tensors.
MAX_WINDOW_PIECES = 4096


def _stage_size(chunk_bytes: int) -> int:
    return -(-chunk_bytes // 8) * 8  # each staged chunk starts 8-byte aligned


def iter_windows(plans: Sequence[ShardPlan], paths: Sequence[str], infos: Mapping[str, Written],
                 window_bytes: int, max_pieces: int = MAX_WINDOW_PIECES) -> Iterator[Window]:
    """Cut every file into windows of at most ``window_bytes`` output bytes and at most
    ``window_bytes`` staging bytes (source dtype, for chunks that are cast). The first
    window of a file starts at byte 0 with the header; where only the output bytes limit
    a window, the next one starts at a multiple of ``window_bytes``, so with a
    ``window_bytes`` that is a multiple of 4096 every window but a file's last can be
    written with O_DIRECT. A window the staging limit or ``max_pieces`` closes early
    ends at a 4096-byte boundary where it can, for the same reason (past ``max_pieces``,
    pieces too small to reach the next boundary are still added, a page's worth at most)."""
    for plan, path in zip(plans, paths):
        head, pos = plan.header, 0
        while len(head) - pos > window_bytes:  # a header larger than a window (many tensors)
            yield Window(path, pos, nbytes=window_bytes, header=head[pos:pos + window_bytes])
            pos += window_bytes
        win = Window(path, pos, nbytes=len(head) - pos, header=head[pos:])
        full = False  # closed early by the staging limit
        for slot in plan.slots:
            info = infos[slot.tensor.name]
            out_dtype = slot.tensor.dtype
            out_size, src_size = out_dtype.itemsize, info.dtype.itemsize
            cast = out_dtype != info.dtype
            done, numel = 0, slot.tensor.numel
            while done < numel:
                room = (window_bytes - win.nbytes) // out_size
                if cast:
                    room = min(room, (window_bytes - win.stage_bytes - 8) // src_size)
                if room <= 0 or full:
                    yield win
                    win, full = Window(path, win.file_offset + win.nbytes), False
                    continue
                take = min(room, numel - done)
                if cast and take < numel - done:
                    # no room after this chunk: end the window on a 4096-byte boundary
                    end = win.file_offset + win.nbytes + take * out_size
                    aligned = (end // 4096 * 4096 - win.file_offset - win.nbytes) // out_size
                    take = aligned if aligned > 0 else take
                    full = True
                elif len(win.pieces) + 1 >= max_pieces:
                    # enough pieces: end the window on the first 4096-byte boundary this
                    # chunk reaches (none reached: take it whole and look again)
                    end = win.file_offset + win.nbytes + take * out_size
                    aligned = (end // 4096 * 4096 - win.file_offset - win.nbytes) // out_size
                    if aligned > 0:
                        take, full = aligned, True
                win.pieces.append(WindowPiece(info, out_dtype, done, take, win.nbytes))
                win.nbytes += take * out_size
                if cast:
                    win.stage_bytes += _stage_size(take * src_size)
                done += take
        if win.nbytes:
            yield win


def fill_window(source: TensorSource, win: Window, out: PooledBuffer, stage: PooledBuffer | None) -> None:
    """Read a window's pieces into ``out``: straight into place where no cast is needed,
    else through ``stage`` and one ``cast_into`` per piece."""
    requests, casts = [], []
    stage_off = 0
    raw = np.frombuffer(out.memoryview(win.nbytes), dtype=np.uint8)
    staging = np.frombuffer(stage.memoryview(win.stage_bytes), dtype=np.uint8) if stage is not None else None
    raw[:len(win.header)] = np.frombuffer(win.header, dtype=np.uint8)
    for c in win.pieces:
        nbytes = c.count * c.out_dtype.itemsize
        dest = raw[c.out_offset:c.out_offset + nbytes].view(c.out_dtype.raw_numpy)
        if c.out_dtype == c.info.dtype:
            requests.append(ReadRequest(c.info.name, c.start, dest, c.info.state))
            continue
        src_bytes = c.count * c.info.dtype.itemsize
        staged = staging[stage_off:stage_off + src_bytes].view(c.info.dtype.raw_numpy)
        stage_off += _stage_size(src_bytes)
        requests.append(ReadRequest(c.info.name, c.start, staged, c.info.state))
        casts.append((dest, c.out_dtype, staged, c.info.dtype))
    source.read(requests)
    for dest, out_dtype, staged, src_dtype in casts:
        cast_into(dest, out_dtype, staged, src_dtype)


# -- the pipeline ---------------------------------------------------------------------------

@dataclass
class ConsolidateResult:
    """What was written: file names (in ``out_dir``), tensor and byte counts, aliases."""

    out_dir: str
    files: list[str]
    tensors: int
    total_bytes: int
    aliases: dict[str, str]
    index: dict | None
    peak_buffer_bytes: int = 0  # most bytes of I/O buffers in use at once


def plan_output(source: TensorSource, max_shard_bytes: int, dtype=FLOAT32,
                exclude_frozen: bool = False
                ) -> tuple[list[ShardPlan], dict | None, dict[str, Written]]:
    """Shard plans, index and the tensors written by name, from metadata only."""
    dtype = as_dtype(dtype)
    infos = {}
    out = []
    for info in written_tensors(source, exclude_frozen):
        if info.name in infos:
            raise InputError(f"tensor {info.name!r} appears twice in the source")
        infos[info.name] = info
        out.append(OutTensor(info.name, tuple(info.shape), output_dtype(info, dtype)))
    aliases = written_aliases(source, exclude_frozen)
    for alias, owner in aliases.items():
        if owner not in infos:
            raise InputError(f"tied weight {alias!r} points at {owner!r}, which is not written")
        if alias in infos:
            raise InputError(f"tied weight {alias!r} is also a tensor of its own")
    plans, index = plan_files(out, max_shard_bytes, aliases)
    return plans, index, infos


class _Stop(Exception):
    pass


def consolidate(source: TensorSource, out_dir: str, *, max_shard_bytes: int = 5 * 10**9,
                dtype=FLOAT32, window_bytes: int = 64 * MiB, depth: int = 1,
                exclude_frozen: bool = False,
                progress: Callable[[int, int], None] | None = None) -> ConsolidateResult:
    """Write ``source`` to ``out_dir`` as (sharded) safetensors; see the module docstring.

    Args:
        max_shard_bytes: shard limit in bytes (Hugging Face's greedy rule).
        dtype: the dtype of every float tensor written (``output_dtype``): a DType
            or any spelling ``dtypes.dtype`` takes (``OUTPUT_DTYPES``: "fp32", "bf16",
            "fp16"), or a torch or numpy dtype.
        exclude_frozen: leave out parameters without gradient (``kind == "frozen"``).
        window_bytes: bytes per I/O window (one reusable buffer).
        depth: windows filled ahead of the one being written.
        progress: called as ``progress(bytes_written, bytes_to_write)``, counting every
            byte of the files (headers included).

    Raises ``OutputLockedError`` (nothing written) when another run is writing into
    ``out_dir``. Whatever happens, ``out_dir`` holds one whole export (``publish``).
    """
    plans, index, infos = plan_output(source, max_shard_bytes, dtype, exclude_frozen)
    check = getattr(source, "check_readable", None)  # any object with tensors/read serves
    if check is not None:  # before files are preallocated to the tensors' shapes
        check([(i.name, i.state) for i in infos.values()])
    total = sum(p.data_bytes for p in plans)
    file_bytes = sum(p.file_size for p in plans)
    _make_out_dir(out_dir)
    with OutputLock(out_dir):
        _remove_stale_staging(out_dir)
        staging = os.path.join(out_dir, f"{_TMP_PREFIX}{os.getpid()}")
        syscalls.makedirs(staging)
        try:
            paths = [os.path.join(staging, p.filename) for p in plans]
            peak = _write_files(source, plans, paths, infos, file_bytes, window_bytes, depth,
                                progress)
            names = publish(staging, out_dir, [p.filename for p in plans], index)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return ConsolidateResult(out_dir, names, len(infos), total,
                             written_aliases(source, exclude_frozen), index, peak)


def _write_files(source, plans, paths, infos, total, window_bytes, depth, progress) -> int:
    """Stream every window into its file; returns the peak bytes of buffers in use."""
    # no bigger than the output needs; at least one element of any dtype plus staging slack
    window_bytes = max(64, min(window_bytes, -(-max(total, 1) // 4096) * 4096)) // 8 * 8
    # Windows start at multiples of window_bytes: with a window that is a multiple of 4096
    # AsyncFileIO writes them with O_DIRECT where the file system accepts it (a file's
    # last, partial, page goes through the page cache: AsyncFileIO cuts it off).
    direct = None if paths and window_bytes % ALIGN == 0 and _direct_ok(os.path.dirname(paths[0])) else False
    # The most slots held at once: two writes in flight, ``depth`` filled windows queued,
    # one being filled and, where tensors are cast, its staging.
    slot = round_up(window_bytes)
    casts = any(s.tensor.dtype != infos[s.tensor.name].dtype for p in plans for s in p.slots)
    with AsyncFileIO(threads=2, queue_depth=4, direct=direct) as fio, \
            BufferPool((depth + 3 + casts) * slot, pin=False) as pool:
        used = _window_bytes_bound(plans, infos, slot)
        for i in range(depth + 3 + casts):
            pool.prefault(i * slot, used)
        for plan, path in zip(plans, paths):
            fio.preallocate(path, plan.file_size)
        filled: queue.Queue = queue.Queue(maxsize=depth)
        stop = threading.Event()

        def acquire(nbytes: int) -> PooledBuffer:
            while True:  # bounded waits so a failed writer can stop us
                if stop.is_set():
                    raise _Stop()
                try:
                    return pool.acquire(nbytes, timeout=0.5, reserve=slot)
                except TimeoutError:
                    continue

        def offer(item) -> bool:
            while not stop.is_set():  # bounded waits so a failed writer can stop us
                try:
                    filled.put(item, timeout=0.5)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                for win in iter_windows(plans, paths, infos, window_bytes):
                    buf = acquire(win.nbytes)
                    stage = acquire(win.stage_bytes) if win.stage_bytes else None
                    try:
                        fill_window(source, win, buf, stage)
                    except BaseException:
                        buf.release()
                        raise
                    finally:
                        if stage is not None:
                            stage.release()
                    if not offer((win, buf)):
                        buf.release()
                        return
                offer(None)
            except _Stop:
                return
            except BaseException as e:  # handed to the writer, raised there
                offer(e)

        reader = threading.Thread(target=produce, name="oe-consolidate-read", daemon=True)
        reader.start()
        written = 0
        pending: list[tuple] = []
        try:
            while True:
                try:
                    item = filled.get(timeout=0.05)
                except queue.Empty:
                    if pending:  # nothing to write yet: let the oldest write finish and free its buffer
                        written += _finish(pending.pop(0))
                        if progress:
                            progress(written, total)
                    continue
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                win, buf = item
                pending.append((_write_window(fio, win, buf), buf, win))
                while len(pending) > 1:  # one write in flight while the next window fills
                    written += _finish(pending.pop(0))
                    if progress:
                        progress(written, total)
            while pending:
                written += _finish(pending.pop(0))
                if progress:
                    progress(written, total)
            for path in paths:
                fio.sync(path).result()
        finally:
            stop.set()
            for fut, buf, _ in pending:
                fut.exception()  # the write is over before its buffer goes back
                buf.release()
            while True:  # drain what the reader queued so its buffers go back
                try:
                    item = filled.get_nowait()
                except queue.Empty:
                    # a finished reader ends the drain at once (a timed get here cost every
                    # run 50 ms after its last write); a live one may still be offering
                    if not reader.is_alive():
                        break
                    reader.join(timeout=0.01)
                    continue
                if isinstance(item, tuple):
                    item[1].release()
            reader.join()
        return pool.peak_in_use


def _window_bytes_bound(plans: Sequence[ShardPlan], infos: Mapping[str, Written],
                        slot: int) -> int:
    """Most bytes of its slot a window (or its staging) can use: the whole slot, unless
    the longest header plus ``MAX_WINDOW_PIECES`` of the largest tensor are less (many
    small tensors close their windows early: 100,000 tensors of 1 KB fill 4 MiB of each
    64 MiB slot, which is all that is touched up front then)."""
    largest = max((s.tensor.numel * max(s.tensor.dtype.itemsize, infos[s.tensor.name].dtype.itemsize)
                   for p in plans for s in p.slots), default=0)
    header = max((len(p.header) for p in plans), default=0)
    # +8 per piece: staged chunks start 8-byte aligned; 2 pages: a window ends on a page
    return min(slot, round_up(header + MAX_WINDOW_PIECES * (largest + 8) + 2 * ALIGN))


def _write_window(fio: AsyncFileIO, win: Window, buf: PooledBuffer) -> IOFuture:
    """Start writing a window from its pool buffer: O_DIRECT when the window starts on a
    page, but for a file's last partial page, which AsyncFileIO sends through the page
    cache."""
    return fio.write(win.path, win.file_offset, buf, length=win.nbytes)


def _direct_ok(directory: str) -> bool:
    """Whether files in ``directory`` take O_DIRECT (tmpfs and some network file systems
    refuse it; they are written through the page cache, without a warning). Any error is
    a no: the writes that follow meet a real one again, and report it."""
    return probe_direct(directory, strict=False)


def _finish(entry) -> int:
    fut, buf, win = entry
    try:
        fut.result()
    finally:
        fut.exception()  # the write is over, even where that wait was cut short, before reuse
        buf.release()
    return win.nbytes


_TMP_PREFIX = ".consolidate-tmp-"  # the staging folder inside OUT, per process


def _make_out_dir(out_dir: str) -> None:
    """Create ``out_dir`` if needed, durably: a new folder's entry is fsynced in its parent,
    so the export published into it cannot vanish with it after a power cut."""
    if os.path.isdir(out_dir):
        return
    syscalls.makedirs(out_dir, exist_ok=True)
    fsync_dir(os.path.dirname(os.path.abspath(out_dir)))


def _remove_stale_staging(out_dir: str) -> None:
    """Remove staging folders that killed runs left. The caller holds OUT's lock, so no
    other run is writing into any of them."""
    for name in os.listdir(out_dir):
        path = os.path.join(out_dir, name)
        if name.startswith(_TMP_PREFIX) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)


# -- verification ---------------------------------------------------------------------------

def verify_output(source: TensorSource, out_dir: str, dtype=FLOAT32,
                  chunk_bytes: int = 64 * MiB, limit: int = 20,
                  exclude_frozen: bool = False) -> list[str]:
    """Re-read ``out_dir`` with the ``safetensors`` library and compare it with ``source``.

    Checks the file set and index (weight_map, total_size, alias metadata), every tensor's
    dtype and shape, and its bytes against the source cast as ``consolidate`` casts them,
    ``chunk_bytes`` at a time (row ranges through ``get_slice``), so memory stays bounded.
    Returns up to ``limit`` problems, one line each; empty when the output matches.
    Reads through torch (the safetensors library's torch loader; torch's own cast as the
    reference for ours), imported here.
    """
    from safetensors import safe_open

    dtype = as_dtype(dtype)
    problems: list[str] = []

    def problem(text: str) -> bool:
        problems.append(text)
        return len(problems) >= limit

    expected = {i.name: i for i in written_tensors(source, exclude_frozen)}
    aliases = written_aliases(source, exclude_frozen)
    index_path = os.path.join(out_dir, INDEX_FILE)
    weight_map = None
    if os.path.exists(index_path):
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
        weight_map = index.get("weight_map", {})
        files = sorted(set(weight_map.values()))
        meta = index.get("metadata", {})
        want_total = sum(i.numel * output_dtype(i, dtype).itemsize for i in expected.values())
        if meta.get("total_size") != want_total:
            problem(f"{INDEX_FILE}: total_size {meta.get('total_size')} != {want_total}")
        for alias, owner in aliases.items():
            if meta.get(alias) != owner:
                problem(f"{INDEX_FILE}: tied weight {alias} -> {owner} not recorded in metadata")
    else:
        files = [SINGLE_FILE]
    seen: dict[str, str] = {}
    for fname in files:
        with safe_open(os.path.join(out_dir, fname), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != "pt":
                problem(f"{fname}: __metadata__ format is {meta.get('format')!r}, not 'pt'")
            keys = set(f.keys())
            for alias, owner in aliases.items():
                if owner in keys and meta.get(alias) != owner:
                    problem(f"{fname}: tied weight {alias} -> {owner} not recorded in __metadata__")
            for name in f.keys():
                if name in seen:
                    if problem(f"{name}: written twice ({seen[name]} and {fname})"):
                        return problems
                    continue
                seen[name] = fname
                if weight_map is not None and weight_map.get(name) != fname:
                    problem(f"{name}: in {fname} but the index says {weight_map.get(name)}")
                info = expected.get(name)
                if info is None:
                    problem(f"{fname}: unexpected tensor {name}")
                elif _verify_tensor(source, f, info, output_dtype(info, dtype), chunk_bytes, fname, problem):
                    return problems
    for name in expected:
        if name not in seen and problem(f"{name}: missing from the output"):
            return problems
    if weight_map is not None:
        for name in weight_map:
            if name not in seen and problem(f"{INDEX_FILE}: maps {name}, which no file holds"):
                return problems
    return problems


def _verify_tensor(source, f, info: Written, out_dtype: DType, chunk_bytes: int,
                   fname: str, problem) -> bool:
    """Compare one tensor; True when the problem limit is reached."""
    import torch

    sl = f.get_slice(info.name)
    shape = tuple(sl.get_shape())
    if sl.get_dtype() != out_dtype.safetensors or shape != tuple(info.shape):
        return problem(f"{fname}: {info.name} is {sl.get_dtype()} {list(shape)}, expected "
                       f"{out_dtype.safetensors} {list(info.shape)}")
    numel = info.numel
    if numel == 0:
        return False
    if not shape:
        ranges = [(0, 1, None)]
    else:
        row = numel // shape[0]
        rows = max(1, (chunk_bytes // info.dtype.itemsize) // row)
        ranges = [(r0, min(shape[0], r0 + rows), row) for r0 in range(0, shape[0], rows)]
    for r0, r1, row in ranges:
        got = f.get_tensor(info.name) if row is None else sl[r0:r1]
        start, count = (0, 1) if row is None else (r0 * row, (r1 - r0) * row)
        want = np.empty(count, dtype=info.dtype.raw_numpy)
        source.read([ReadRequest(info.name, start, want, info.state)])
        want = as_torch_view(want, info.dtype).to(out_dtype.torch)
        if not torch.equal(got.reshape(-1).view(torch.uint8), want.view(torch.uint8)):
            return problem(f"{fname}: {info.name} differs from the source in elements "
                           f"[{start}, {start + count})")
    return False
