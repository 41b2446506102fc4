"""Our live stores and checkpoint generations as a ``TensorSource``: a zarr group whose
attributes are the tensor table, and one shard table per rank (docs/format.md, "Manifest").

Listing reads the group's zarr.json and nothing else (files are only stat-ed, to name a
missing rank at once). Reading data opens the arrays it touches and parses the shard
tables of the ranks that hold the rows it asks for (``shard_tables``), one rank at a time,
on first need: a rank loading a checkpoint at the same world size reads its own table.
Reading goes through the engine's own chunk I/O (``AsyncFileIO``, O_DIRECT into
``BufferPool`` buffers); ``scan`` walks each array in storage order, window by window with
read-ahead, and hands every window to the caller with the tensor pieces it holds.
Checkpoint chunks are checked against the crc32c their manifest records: each chunk is read
whole and verified the first time a reader touches it, before any of its bytes is
returned, and a checkpoint array the engine did not write (a codec other than plain
little-endian bytes) is refused.

Every reader of our format goes through here: ``checkpoint.load``, consolidate, inspect,
diff and export. Nothing here imports torch (``scan`` does, for its caller's statistics).
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import functools
import math
import os
from typing import Sequence

from ...io import AsyncFileIO, BufferPool, device_profile
from ...io.align import as_byte_view
from ...layout import FlatArray, MetadataError, NodeNotFoundError
from ...layout.checksums import ChecksumError, mismatch
from ...layout.box_runs import box_runs, overlap
from ...layout.manifest import (BOX_CHECKPOINT_VERSION, SHARDS, array_metadata_key, iter_shard_table,
                                shard_table_key, shard_table_path)
from ...layout.member_paths import inside
from ...layout.metadata_crc import file_crc32c
from ...units import MiB
from ..errors import CheckpointError
from ..source import KIND_LABELS, Progress, SourceInfo, TensorMeta, TensorSource, Visit
from .checkpoint_listing import find_generation, was_removed
from .shard_tables import ShardTables
from .tensor_table import gc_paused, parse_manifest, read_manifest_attrs
from .windows import ChunkedArray, RangeReader, WindowStream
from ...errors import InputError, OffloadEngineError

DEFAULT_WINDOW = 16 * MiB
DEFAULT_DEPTH = 4   # windows read ahead: 80 MiB in flight at 16 MiB, more than fio's 8 x 8 MiB


def _removal_reported(method):
    """``method`` of a checkpoint generation's reader, its errors checked for a generation
    removed meanwhile (``keep_last`` of the run writing the folder): that is reported as
    ``GenerationRemovedError`` for every reader at once (load, consolidate, inspect, diff,
    export), while a file missing from a generation still there stays corruption."""
    def reported(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (OffloadEngineError, OSError) as e:
            removed = (was_removed(self.group, e)
                       if getattr(self, "kind", None) == "checkpoint" else None)
            if removed is None:
                raise
            raise removed from e
    return functools.wraps(method)(reported)


class OursSource(TensorSource):
    """A store directory (``kind="store"``) or one checkpoint generation (``"checkpoint"``).

    Args:
        group: the zarr group holding the manifest.
        kind: "store" or "checkpoint".
        generation: the generation's name (checkpoints), shown in the summary.
        window_bytes: bytes per read window (a multiple of 4096).
        depth: windows read ahead while one is processed.
        io_threads: threads issuing reads.
        attrs: the group's attributes when the caller already parsed them (``detect``).
        verify_all_metadata: before the first read of data, check the crc32c of every
            metadata file the manifest records (version 3 checkpoints), not only of those
            the reads use: a damaged byte anywhere is an error. A rank of a distributed
            load passes False: it checks the files it reads (its own shard table, rank
            0's, its arrays), and W ranks reading every table would read them W times.
    """

    @_removal_reported
    def __init__(self, group: str, kind: str, generation: str | None = None,
                 window_bytes: int = DEFAULT_WINDOW, depth: int = DEFAULT_DEPTH,
                 io_threads: int = 8, attrs: dict | None = None,
                 verify_all_metadata: bool = True):
        if window_bytes <= 0 or window_bytes % 4096:
            raise InputError(f"window size must be a positive multiple of 4096, got {window_bytes}")
        self.group = os.path.abspath(group)
        self.kind = kind
        self.window_bytes = window_bytes
        self.depth = depth
        where = os.path.join(self.group, "zarr.json")
        with gc_paused():
            if attrs is None:
                attrs = read_manifest_attrs(self.group)
            self.manifest = parse_manifest(attrs, kind, where)
        m = self.manifest
        # a store of one rank in its own folder keeps that rank's shard table beside the
        # tensor table (format version 3); others in group rank{r}
        self._inline_table = attrs.get(SHARDS) if m.inline_shards else None
        self._check_ranks()
        files = [(where, os.path.getsize(where))] + self._stat_shard_tables()
        self._stat_arrays()
        self.info = SourceInfo(
            kind=kind, path=self.group, format=m.format, format_version=m.format_version,
            step=m.step, generation=generation, world_size=m.world_size, files=files,
            file_count=len(files) + len(m.arrays) + self._declared_chunks())
        if not m.has_tensor_table:
            self.info.notes.append("no tensor table in the manifest (the optimizer has not "
                                   "written one): flat arrays are listed as they are")
        if kind == "checkpoint" and m.metadata_crcs is None:
            self.info.notes.append(f"format version {m.format_version}: chunk data is "
                                   f"checksummed, the metadata (manifest, shard tables, array "
                                   f"zarr.json) is not: a damaged byte there may go unnoticed")
        self._metadata_unverified = verify_all_metadata and m.metadata_crcs is not None
        # the device profile's read choice where one is cached (buffered with readahead on
        # disks that read faster that way), else O_DIRECT at io_threads in flight
        read = device_profile.reader_settings(self.group, io_threads, 8 * MiB)
        self.io_settings = {"read": read.as_dict()}
        self._io = AsyncFileIO(threads=max(io_threads, read.queue_depth), read=read)
        self._arrays: dict[str, ChunkedArray] = {}
        self._tables = ShardTables(m) if m.has_tensor_table else None
        self._pool: BufferPool | None = None
        self._ranges: RangeReader | None = None
        self._disjoint: set[str] = set()   # box tensors checked not to overlap

    @_removal_reported
    def verify_metadata(self) -> None:
        """Check the crc32c of every metadata file the manifest records (shard tables and
        array zarr.json files; the manifest's own seal was checked when it was read) without
        parsing them. ChecksumError or CheckpointError naming the file."""
        for name, crc in (self.manifest.metadata_crcs or {}).items():
            path = inside(self.group, name, CheckpointError, "metadata file")
            try:
                actual = file_crc32c(path)
            except FileNotFoundError:
                raise CheckpointError(f"{path}: missing, but the checkpoint manifest records "
                                      f"its crc32c") from None
            except OSError as e:
                raise CheckpointError(f"{path}: unreadable ({e.strerror or e})") from None
            if actual != crc:
                raise mismatch(path, actual, crc)
        self._metadata_unverified = False

    def _before_data(self) -> None:
        """What every read of data does first (``verify_all_metadata``)."""
        if self._metadata_unverified:
            self.verify_metadata()

    @classmethod
    def open_checkpoint(cls, ckpt_dir: str, tag: str | None = None, **options) -> "OursSource":
        """The generation ``tag`` of the checkpoint directory ``ckpt_dir`` (default: the
        one ``latest`` names), or ``ckpt_dir`` itself when it is a generation; a torn
        (``.partial``) generation is refused, whatever its manifest says."""
        gen = find_generation(ckpt_dir, tag)
        return cls(gen, "checkpoint", generation=os.path.basename(os.path.normpath(gen)),
                   **options)

    # -- metadata: what listing checks without reading ------------------------------------
    def _table_path(self, rank: int) -> str:
        """The zarr.json that holds rank ``rank``'s shard table."""
        if self.manifest.inline_shards:
            return os.path.join(self.group, "zarr.json")
        return shard_table_path(self.group, rank)

    def _stat_shard_tables(self) -> list[tuple[str, int]]:
        """(path, bytes) of each held rank's shard table; a missing one names the rank."""
        if self.manifest.inline_shards:
            return []  # in the manifest, counted already
        out = []
        for r in self.manifest.ranks:
            path = shard_table_path(self.group, r)
            try:
                out.append((path, os.path.getsize(path)))
            except FileNotFoundError:
                raise self._missing_table(r) from None
        return out

    def _missing_table(self, rank: int) -> CheckpointError:
        return CheckpointError(f"{self._table_path(rank)}: rank {rank}'s shard "
                               f"table is missing (rank {rank} missing?)")

    def _read_table(self, rank: int):
        """Rank ``rank``'s shard table: the inline dict, or its ``(tensor, shard)`` pairs
        parsed one at a time (its crc32c checked first where recorded)."""
        if self.manifest.inline_shards:
            if not isinstance(self._inline_table, dict):
                raise CheckpointError(f"{self._table_path(rank)}: no shard table (a "
                                      f"'{SHARDS}' object in the store's attributes)")
            return self._inline_table
        crcs = self.manifest.metadata_crcs
        return iter_shard_table(self.group, rank, crcs[shard_table_key(rank)] if crcs else None)

    def _missing_array(self, name: str) -> CheckpointError:
        rank = self.manifest.arrays[name].rank
        hint = f" (rank {rank} missing?)" if rank is not None else ""
        return CheckpointError(f"{os.path.join(self.group, name)}: cannot open array {name!r} "
                               f"listed in the manifest: it is missing{hint}")

    def _array_path(self, name: str) -> str:
        """Where array ``name`` of the manifest is, checked to lie inside the group."""
        return inside(self.group, name, CheckpointError, "array name")

    def _stat_arrays(self) -> None:
        for name in self.manifest.arrays:
            if not os.path.isfile(os.path.join(self._array_path(name), "zarr.json")):
                raise self._missing_array(name)

    def _declared_chunks(self) -> int:
        """Chunk files the arrays may have: the checksums' count (checkpoints), else
        numel / chunk size where the store records it."""
        m, n = self.manifest, 0
        for name, a in m.arrays.items():
            if m.checksums is not None and name in m.checksums:
                n += len(m.checksums[name])
            elif a.chunk_elems:
                n += -(-a.numel // a.chunk_elems)
        return n

    def _check_ranks(self) -> None:
        m = self.manifest
        if m.world_size is None:
            return
        ranks = {a.rank for a in m.arrays.values() if a.rank is not None}
        if self.kind == "checkpoint" and m.format_version >= BOX_CHECKPOINT_VERSION:
            return  # a rank may hold no array (an HSDP replica); its shard table must be there
        if m.has_tensor_table:
            missing = sorted(set(m.ranks) - ranks)
        else:  # every rank of world_size, which nothing bounded: list a few, not all
            held = sum(1 for r in ranks if r < m.world_size)
            missing = ([r for r in range(len(ranks) + 3) if r not in ranks][:3]
                       if held < m.world_size else [])
        if ranks and missing:
            raise CheckpointError(f"{self.group}: world_size is {m.world_size} but no array "
                                  f"belongs to rank(s) {missing} (a missing rank)")

    # -- data: arrays and shard tables, on first use -------------------------------------
    def _array(self, name: str) -> ChunkedArray:
        array = self._arrays.get(name)
        if array is None:
            array = self._arrays[name] = self._open_array(name)
        return array

    def _open_array(self, name: str) -> ChunkedArray:
        entry = self.manifest.arrays[name]
        path = self._array_path(name)  # again: a symlink may have changed since listing
        crcs = self.manifest.metadata_crcs
        try:
            flat = FlatArray.open(path, io=self._io, mode="r",
                                  metadata_crc32c=crcs[array_metadata_key(name)] if crcs else None)
        except NodeNotFoundError:  # deleted since listing checked it
            raise self._missing_array(name) from None
        except ChecksumError:  # names the file already
            raise
        except (MetadataError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot open: {e}") from None
        if flat.element != entry.dtype or flat.numel != entry.numel:
            raise CheckpointError(f"{path}: array holds {flat.numel} x {flat.element}, the "
                                  f"manifest says {entry.numel} x {entry.dtype}")
        crcs = None
        if self.manifest.checksums is not None:
            if not flat.direct:  # the engine writes plain little-endian chunks only
                raise CheckpointError(f"{path}: not an array the engine wrote: "
                                      f"{flat.foreign_problem}")
            crcs = self.manifest.checksums.get(name)
            if crcs is None:
                raise CheckpointError(f"{path}: no checksums recorded for array {name!r} in the "
                                      f"checkpoint manifest")
            if len(crcs) != flat.nchunks:
                raise CheckpointError(f"{path}: the manifest records {len(crcs)} checksums, "
                                      f"the array has {flat.nchunks} chunks")
        return ChunkedArray(name, flat, crcs)

    def _add_ranks(self, ranks) -> None:
        """Parse and check the shard tables of ``ranks`` not read yet."""
        tables = self._tables
        todo = [r for r in ranks if r not in tables.ranks]
        if not todo:
            return
        with gc_paused():
            for r in todo:
                try:
                    tables.add(r, self._read_table(r), self._table_path(r))
                except NodeNotFoundError:  # deleted since listing checked it
                    raise self._missing_table(r) from None
                except MetadataError as e:
                    raise CheckpointError(str(e)) from None

    @_removal_reported
    def placements(self) -> dict:
        """{(tensor, state): [Placement]} from every held rank's shard table."""
        self._before_data()
        if self._tables is None:
            return self.manifest.placements
        if self._tables.kept_states is not None:
            self._tables.keep_all()
        self._add_ranks(self.manifest.ranks)
        return self._tables.all_placements()

    def _placements_for(self, t: TensorMeta, state: str, lo: int, hi: int) -> list:
        """The placements of ``t``'s ``state`` covering elements ``[lo, hi)``."""
        if self._tables is None:
            return self.manifest.placements.get((t.name, state), [])
        if not self._tables.keeps(state):  # a state check_readable did not name: parse again
            self._tables.keep_all()
        row_numel = math.prod(t.shape[1:]) or 1
        self._add_ranks(self._tables.ranks_for(t.name, lo // row_numel, -(-hi // row_numel)))
        return self._tables.placements(t.name, state)

    # -- TensorSource ----------------------------------------------------------------------
    @_removal_reported
    def aliases(self) -> dict[str, str]:
        """``{alias: owner}``: tied names the save recorded (the manifest's ``aliases``),
        checked: each owner a tensor of the table, no alias one. CheckpointError naming the
        manifest otherwise."""
        doc = self.manifest.extra.get("aliases")
        if doc is None:
            return {}
        where = os.path.join(self.group, "zarr.json")
        names = {t.name for t in self.manifest.tensors}
        if not isinstance(doc, dict):
            raise CheckpointError(f"{where}: 'aliases' must be an object {{alias: owner}}")
        for alias, owner in doc.items():
            if not isinstance(owner, str) or owner not in names:
                raise CheckpointError(f"{where}: tied name {alias!r} points at {owner!r}, which "
                                      "is not a tensor of the checkpoint")
            if alias in names:
                raise CheckpointError(f"{where}: tied name {alias!r} is also a tensor of its own")
        return dict(doc)

    def tensors(self) -> list[TensorMeta]:
        return self.manifest.tensors

    @_removal_reported
    def check_readable(self, keys) -> None:
        """The metadata checksums, the shard tables that hold ``keys`` and the zarr.json of
        every array they point into (dtype, numel and chunk count against the manifest):
        a tensor's shape is then backed by arrays whose own metadata declares its size."""
        self._before_data()
        keys = list(keys)
        if self._tables is not None and not self._tables.ranks:
            # keep the placements of the states to be read alone: a consolidation of
            # masters does not hold the Adam moments' 2 of every 3 (checked all the same)
            self._tables.keep_only({state for _, state in keys})
        for name, state in keys:
            t = self.tensor(name)
            for p in self._placements_for(t, state, 0, t.numel):
                self._array(p.array)

    def describe(self) -> str:
        return (f"{KIND_LABELS[self.kind]} {self.group} (step {self.manifest.step}, world size "
                f"{self.manifest.world_size})")

    def _range_reader(self) -> RangeReader:
        if self._ranges is None:
            # two windows for verifying a chunk, two of cached blocks: flat in the input
            self._pool = BufferPool(2 * self.window_bytes)
            self._ranges = RangeReader(self._io, self._pool, self.window_bytes,
                                       cache_bytes=2 * self.window_bytes)
        return self._ranges

    @_removal_reported
    def read(self, requests) -> None:
        self._before_data()
        for req in requests:
            t = self.tensor(req.name)
            state = req.state or t.value_state()
            sm = t.states.get(state)
            if sm is None:
                raise CheckpointError(f"{self.group}: tensor {req.name!r} has no state {state!r}")
            dest = as_byte_view(req.out)
            size = sm.dtype.itemsize
            lo, hi = req.start, req.start + len(dest) // size
            if lo < 0 or hi > sm.numel:
                raise CheckpointError(f"{req.name}/{state}: elements [{lo}, {hi}) are outside "
                                      f"the tensor's {sm.numel}")
            self._read_range(t, state, lo, hi, dest, size)

    def _read_range(self, t: TensorMeta, state: str, lo: int, hi: int, dest: memoryview,
                    size: int) -> None:
        placements = self._placements_for(t, state, lo, hi)
        if t.name in self.manifest.boxes:
            self._read_boxes(t, state, placements, lo, hi, dest, size)
            return
        i = max(0, bisect.bisect_right(placements, (lo, float("inf"))) - 1)
        reader = self._range_reader()
        pos = lo
        for p in placements[i:]:
            if pos >= hi:
                break
            if p.dest + p.numel <= pos:
                continue
            if p.dest > pos:
                break  # rows no shard of this group holds (a live store has one rank's)
            take = min(hi, p.dest + p.numel) - pos
            a = p.offset + pos - p.dest
            reader.read(self._array(p.array), a, a + take, dest[(pos - lo) * size:(pos - lo + take) * size])
            pos += take
        if pos < hi:
            m = self.manifest
            where = ("outside the tensor" if m.all_ranks or not m.has_tensor_table else
                     f"held by other ranks (this store holds rank {m.ranks[0]} of {m.world_size})")
            raise CheckpointError(f"{t.name}/{state}: elements [{pos}, {hi}) are {where}")

    def _read_boxes(self, t: TensorMeta, state: str, placements: list, lo: int, hi: int,
                    dest: memoryview, size: int) -> None:
        """Elements ``[lo, hi)`` of a tensor held as boxes: the runs of every box that fall
        there (the boxes do not overlap, so the elements copied add up to ``hi - lo`` exactly
        when every element is held)."""
        self._check_disjoint(t)
        reader = self._range_reader()
        got = 0
        for p in placements:
            array = self._array(p.array)
            for at, inside, n in box_runs(t.shape, p.box[0], p.box[1], lo, hi):
                a = p.offset + inside
                reader.read(array, a, a + n, dest[(at - lo) * size:(at - lo + n) * size])
                got += n
        if got < hi - lo:
            m = self.manifest
            where = ("in no box" if m.all_ranks else
                     f"held by other ranks (this store holds rank {m.ranks[0]} of {m.world_size})")
            raise CheckpointError(f"{t.name}/{state}: {hi - lo - got} of elements [{lo}, {hi}) "
                                  f"are {where}")

    def _check_disjoint(self, t: TensorMeta) -> None:
        """A group of every rank: no two ranks' boxes of ``t`` overlap (once per tensor; the
        tensor table's parse checked that their elements add up to the tensor's)."""
        if not self.manifest.all_ranks or t.name in self._disjoint:
            return
        boxes = [b for b in self.manifest.boxes[t.name] if b is not None and math.prod(b[1])]
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                if overlap(a, b):
                    raise CheckpointError(
                        f"{os.path.join(self.group, 'zarr.json')}: tensor {t.name!r}: boxes "
                        f"start={list(a[0])} shape={list(a[1])} and start={list(b[0])} "
                        f"shape={list(b[1])} of 'boxes_per_rank' overlap")
        self._disjoint.add(t.name)

    @_removal_reported
    def scan(self, keys: Sequence[tuple[str, str]], visit: Visit, progress: Progress | None = None,
             window_bytes: int | None = None, workers: int = 1) -> int:
        """Array by array, window by window, in storage order; each window's tensor pieces
        go to ``visit`` together (as a 1-D torch tensor of the array's dtype: imports
        torch). Only windows holding a wanted element are read. With ``workers`` > 1,
        ``visit`` runs on that many threads at once (it must be thread-safe) while the next
        windows are read."""
        import torch

        segments: dict[str, list[tuple[int, int, int]]] = {}
        placements = self.placements()
        for k, key in enumerate(keys):
            for p in placements.get(key, []):
                if p.numel:
                    segments.setdefault(p.array, []).append((p.offset, p.offset + p.numel, k))
        plan = []
        for name in sorted(segments):
            segs = sorted(segments[name])
            array = self._array(name)
            chunks = sorted({c for lo, hi, _ in segs
                             for c in range(array.chunk_of(lo), array.chunk_of(hi - 1) + 1)})
            plan.append((array, segs, chunks))
        wb = window_bytes or self.window_bytes
        windows = [w for array, _, chunks in plan for c in chunks for w in array.windows(c, wb)]
        total = sum(w.nbytes for w in windows)
        seg_by_array = {id(array): segs for array, segs, _ in plan}
        nw = max(1, workers)
        pool = BufferPool((self.depth + 2 + nw) * wb)
        stream = WindowStream(self._io, pool, self.depth)
        done = 0
        cursor: dict[int, int] = {}
        inflight: collections.deque = collections.deque()
        ex = concurrent.futures.ThreadPoolExecutor(nw, thread_name_prefix="oe-inspect") \
            if nw > 1 else None
        try:
            for w, data, release in stream.stream_detached(windows):
                done += w.nbytes
                pieces = []
                if w.elems:
                    segs = seg_by_array[id(w.array)]
                    pieces = _pieces(segs, cursor, id(w.array), w.elem_start, w.elem_start + w.elems)
                if not pieces:
                    release()
                else:
                    flat = w.array.flat
                    view = torch.frombuffer(data, dtype=torch.uint8)[:w.elems * flat.itemsize] \
                        .view(flat.dtype)
                    if ex is None:
                        try:
                            visit(view, pieces)
                        finally:
                            release()
                    else:
                        inflight.append((ex.submit(visit, view, pieces), release))
                        while len(inflight) > nw:  # nw reducing, one queued
                            fut, rel = inflight.popleft()
                            try:
                                fut.result()
                            finally:
                                rel()
                if progress:
                    progress(done, total)
            while inflight:
                fut, rel = inflight.popleft()
                try:
                    fut.result()
                finally:
                    rel()
        finally:
            for fut, rel in inflight:  # an error: let the workers finish before freeing
                concurrent.futures.wait([fut])
                rel()
            if ex is not None:
                ex.shutdown(wait=True)
            pool.close()
        return stream.bytes_read

    def close(self) -> None:
        if self._ranges is not None:
            self._ranges.close()
        if self._pool is not None:
            self._pool.close()
        self._io.close()


def _pieces(segs: list, cursor: dict, key: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(key index, start, stop) relative to ``lo`` of the sorted segments inside [lo, hi);
    ``cursor`` remembers where the previous window of the array stopped looking."""
    i = cursor.get(key, 0)
    while i < len(segs) and segs[i][1] <= lo:
        i += 1
    cursor[key] = i
    out = []
    while i < len(segs) and segs[i][0] < hi:
        s, e, k = segs[i]
        out.append((k, max(s, lo) - lo, min(e, hi) - lo))
        i += 1
    return out
