"""The methods `bench io` compares: the engine, fio (or a plain O_DIRECT loop), zarr-python
and tensorstore. Each has describe(), write() and read() (seconds, CPU seconds) and cleanup().
"""

from __future__ import annotations

import collections
import errno
import itertools
import json
import math
import mmap
import os
import shutil
import subprocess
import threading
import time
import numpy as np
from ..io import AsyncFileIO, BufferPool, probe_direct  # noqa: F401 (probe_direct: for bench_io)
from ..io.errors import FileIOError
from ..io.page_cache import evict_and_check, sync_tree
from ..layout import FlatArray
from ..units import format_bytes
from ..errors import InputError


ITEMSIZE = 4  # float32


class BenchError(InputError):
    """A problem the user can act on (bad directory, no space, bad sizes): one line, exit 2."""

# --------------------------------------------------------------------------------------------
# data, page cache, O_DIRECT
# --------------------------------------------------------------------------------------------
def fill_pattern(dst: np.ndarray, seed: int) -> None:
    """Fill the uint8 array ``dst`` with non-zero bytes that depend on ``seed`` and position
    (cheap to regenerate for checks; never equal to the fill value)."""
    step = 1 << 22
    for off in range(0, len(dst), step):
        n = min(step, len(dst) - off)
        words = np.arange(off // 4, off // 4 + -(-n // 4), dtype=np.uint32)
        words *= np.uint32(2654435761)
        words ^= np.uint32((seed * 40503 + 0x9E3779B9) & 0xFFFFFFFF)
        words |= np.uint32(0x01010101)  # no zero byte anywhere
        dst[off:off + n] = words.view(np.uint8)[:n]


# --------------------------------------------------------------------------------------------
# methods: describe(), write() and read() (each returns seconds), cleanup()
# --------------------------------------------------------------------------------------------
class EngineBench:
    """The FlatArray, chunk by chunk through a ring of pooled buffers.

    Chunk i is written from, and read into, ring slot i % nslots. There are enough slots
    that queue-depth pieces are always queued at AsyncFileIO while the oldest chunk's
    request completes, and that every stream has a request to serve: the larger of
    ceil(QD * piece / chunk) + 1 and streams + 1 (at least 2, at most one per chunk).
    """

    def __init__(self, array: FlatArray, io: AsyncFileIO, block_size: int):
        self.array = array
        self.io = io
        chunk = array.chunk_bytes
        piece = min(block_size, chunk)
        streams = max(io.settings(op).streams for op in ("read", "write"))
        self.nslots = min(array.nchunks, max(2, math.ceil(io.queue_depth * piece / chunk) + 1,
                                             streams + 1))
        self.pool = BufferPool(self.nslots * chunk)
        self.ring = [self.pool.acquire(chunk) for _ in range(self.nslots)]
        for slot, buf in enumerate(self.ring):
            fill_pattern(buf.bytes.numpy(), seed=slot)
        self.direct_pieces = 0
        self.buffered_pieces = 0
        self.resident = 0  # most bytes of the file(s) found cached just before a read

    def describe(self) -> str:
        a = self.array
        rd, wr = self.io.settings("read"), self.io.settings("write")
        return (f"FlatArray float32, {a.nchunks} chunk file(s) of {format_bytes(a.chunk_bytes)}, "
                f"preallocated once and overwritten in place; ring of {self.nslots} pooled "
                f"buffers; AsyncFileIO reads {rd.mode} QD {rd.queue_depth} pieces of "
                f"{format_bytes(rd.block_bytes)} from {rd.streams} chunk(s) at once, writes "
                f"{wr.mode} QD {wr.queue_depth} pieces of {format_bytes(wr.block_bytes)} to "
                f"{wr.streams} at once ({self.io.threads} threads); write time includes "
                f"fdatasync of every chunk file")

    def expected_chunk(self, i: int) -> np.ndarray:
        """The bytes chunk ``i`` holds after a write run (edge chunk: its leading part)."""
        n = min(self.array.chunk_bytes, self.array.numel * ITEMSIZE - i * self.array.chunk_bytes)
        out = np.empty(self.array.chunk_bytes, dtype=np.uint8)
        fill_pattern(out, seed=i % self.nslots)
        return out[:n]

    def _pump(self, write: bool) -> None:
        a, ce = self.array, self.array.chunk_elems
        pending = collections.deque()
        for i in range(a.nchunks):
            if len(pending) == self.nslots:
                pending.popleft().result()
            start, stop = i * ce, min((i + 1) * ce, a.numel)
            buf = self.ring[i % self.nslots]
            move = a.write_from if write else a.read_into
            pending.append(move(start, stop, buf))
        while pending:
            pending.popleft().result()

    def write(self) -> tuple[float, float]:
        self.io.reset_stats()
        with Stopwatch() as sw:
            self._pump(write=True)
            self.array.sync().result()
        self._count()
        return sw.wall, sw.cpu

    def read(self) -> tuple[float, float]:
        self.resident = max(self.resident, evict_and_check([self.array.path]))
        for buf in self.ring:  # the check below then sees bytes that came from the disk
            buf.bytes.zero_()
        self.io.reset_stats()
        with Stopwatch() as sw:
            self._pump(write=False)
        self._count()
        for slot, buf in enumerate(self.ring):  # holds the last chunk read into this slot
            last = max(i for i in range(self.array.nchunks) if i % self.nslots == slot)
            expect = self.expected_chunk(last)
            if not np.array_equal(buf.bytes.numpy()[:len(expect)], expect):
                raise RuntimeError(f"engine read back wrong bytes from "
                                   f"{self.array.chunk_path(last)}")
        return sw.wall, sw.cpu

    def _count(self) -> None:
        self.direct_pieces += self.io.stats.direct_pieces
        self.buffered_pieces += self.io.stats.buffered_pieces

    def cleanup(self) -> None:
        pass

    def close(self) -> None:
        for buf in self.ring:
            buf.release()
        self.ring = []
        self.pool.close()


def fio_job_args(size: int, block: int, queue_depth: int, streams: int) -> list[str]:
    """fio options that move ``size`` bytes in ``block``-byte requests, ``queue_depth`` in
    flight, over ``streams`` regions: that many jobs, each on its own 1/streams of the file at
    queue_depth / streams (one job where a region would not hold whole blocks)."""
    if streams < 1 or size % (streams * block):
        streams = 1
    depth = f"--iodepth={max(1, queue_depth // streams)}"
    if streams == 1:
        return [f"--size={size}", depth]
    return [f"--numjobs={streams}", f"--offset_increment={size // streams}",
            f"--size={size // streams}", "--group_reporting", depth]


class FioBench:
    """fio on one file: with ``direct``, libaio at the engine's queue depth, block size and
    streams of each direction (``streams`` jobs, each on its own 1/streams of the file at
    queue depth / streams, as the engine serves that many chunk files at once); without,
    one psync job through the page cache (kernel readahead) at the same block size.
    ``shape``: {"read": (block bytes, queue depth, streams), "write": ...}."""

    def __init__(self, path: str, size: int, shape: dict, direct: bool):
        self.path = path
        self.size = size
        self.resident = 0
        engine = "--ioengine=libaio" if direct else "--ioengine=psync"
        self.common = [f"--filename={path}", f"--direct={int(direct)}",
                       engine, "--output-format=json"]
        self.args = {}
        for rw in ("write", "read"):
            bs, qd, streams = shape[rw]
            jobs = fio_job_args(size, bs, qd, streams) if direct else fio_job_args(size, bs, 1, 1)
            extra = ["--end_fsync=1"] if rw == "write" else []
            self.args[rw] = ["fio", f"--name={rw}", *self.common, *jobs, f"--bs={bs}",
                             f"--rw={rw}", *extra]

    def describe(self) -> str:
        return ("fio " + " | ".join(" ".join(a for a in self.args[rw][2:]
                                             if not a.startswith(("--filename", "--output")))
                                    for rw in ("write", "read"))
                + "; write's --end_fsync=1 is counted in fio's runtime; bw_bytes")

    def _run(self, rw: str) -> tuple[float, float]:
        proc = subprocess.run(self.args[rw], capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
            raise BenchError(f"fio --rw={rw} failed (exit {proc.returncode}): {last}")
        text = proc.stdout
        try:
            doc = json.loads(text[text.index("{"):])
            job = doc["jobs"][0]
            part = job[rw]
            bw, moved = part["bw_bytes"], part["io_bytes"]
        except (ValueError, KeyError, IndexError) as e:
            raise BenchError(f"fio --rw={rw}: unreadable JSON output ({e})") from None
        if job.get("error"):
            raise BenchError(f"fio --rw={rw}: job error {job['error']}")
        if moved != self.size or bw <= 0:
            raise BenchError(f"fio --rw={rw} moved {moved} bytes of {self.size}")
        # fio's CPU figures are percentages of the job's run time
        cpu_share = (job.get("usr_cpu", 0.0) + job.get("sys_cpu", 0.0)) / 100
        cpu = cpu_share * job.get("job_runtime", 0) / 1e3
        return self.size / bw, cpu

    def write(self) -> tuple[float, float]:
        return self._run("write")

    def read(self) -> tuple[float, float]:
        self.resident = max(self.resident, evict_and_check([self.path]))
        return self._run("read")

    def cleanup(self) -> None:
        pass


class ODirectLoopBench:
    """The plain device loop: QD threads, each with its own aligned buffer, taking the next
    block-size slot of one O_DIRECT file in turn (os.pwritev / os.preadv release the GIL)."""

    def __init__(self, path: str, size: int, block_size: int, qd: int, direct: bool):
        self.path, self.size, self.bs, self.qd, self.direct = path, size, block_size, qd, direct
        self.resident = 0
        self.bufs = [mmap.mmap(-1, block_size) for _ in range(qd)]
        for k, buf in enumerate(self.bufs):
            fill_pattern(np.frombuffer(buf, dtype=np.uint8), seed=100 + k)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.posix_fallocate(fd, 0, size)  # laid out untimed, as fio does
        finally:
            os.close(fd)

    def describe(self) -> str:
        return (f"os.pwritev/os.preadv in {self.qd} threads, {format_bytes(self.bs)} blocks, "
                f"{'O_DIRECT' if self.direct else 'buffered'}, one file; write time includes "
                f"fdatasync")

    def _go(self, write: bool) -> tuple[float, float]:
        flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_CLOEXEC
        if self.direct:
            flags |= os.O_DIRECT
        fd = os.open(self.path, flags)
        nblocks = self.size // self.bs
        counter = itertools.count()
        errors: list[BaseException] = []

        def worker(k: int) -> None:
            view = memoryview(self.bufs[k])
            try:
                while not errors:
                    i = next(counter)  # atomic under the GIL
                    if i >= nblocks:
                        return
                    off, done = i * self.bs, 0
                    while done < self.bs:
                        if write:
                            n = os.pwritev(fd, [view[done:]], off + done)
                        else:
                            n = os.preadv(fd, [view[done:]], off + done)
                        if n <= 0:
                            raise FileIOError(errno.EIO, "write" if write else "read", self.path,
                                              off + done, self.bs - done, detail="moved no bytes")
                        done += n
            except BaseException as e:
                errors.append(e)

        try:
            with Stopwatch() as sw:
                threads = [threading.Thread(target=worker, args=(k,)) for k in range(self.qd)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                if errors:
                    raise errors[0]
                if write:
                    os.fdatasync(fd)
            return sw.wall, sw.cpu
        finally:
            os.close(fd)

    def write(self) -> tuple[float, float]:
        return self._go(write=True)

    def read(self) -> tuple[float, float]:
        self.resident = max(self.resident, evict_and_check([self.path]))
        return self._go(write=False)

    def cleanup(self) -> None:
        for buf in self.bufs:
            buf.close()
        self.bufs = []


class _PeerBench:
    """Shared by the zarr-python and tensorstore methods: reads of the engine's array into
    ``host``; writes of ``host`` into a new array of the same shape and chunking."""

    name = ""

    def __init__(self, array: FlatArray, workdir: str, host: np.ndarray, expected_chunk):
        self.src = array.path
        self.numel = array.numel
        self.chunk_elems = array.chunk_elems
        self.nchunks = array.nchunks
        self.dst = os.path.join(workdir, f"{self.name}.zarr")
        self.host = host
        self.expected_chunk = expected_chunk
        self.resident = 0

    def _checked_chunks(self) -> list[int]:
        return sorted({0, self.nchunks // 2, self.nchunks - 1})

    def _chunk_bytes(self, i: int) -> np.ndarray:
        b = self.host.view(np.uint8)
        cb = self.chunk_elems * ITEMSIZE
        return b[i * cb:min((i + 1) * cb, len(b))]

    def read(self) -> tuple[float, float]:
        self.resident = max(self.resident, evict_and_check([self.src]))
        for i in self._checked_chunks():
            self._chunk_bytes(i)[:] = 0
        handle = self._open_source()
        with Stopwatch() as sw:
            self._read_into(handle)
        for i in self._checked_chunks():
            if not np.array_equal(self._chunk_bytes(i), self.expected_chunk(i)):
                raise RuntimeError(f"{self.name} read different bytes from chunk {i} of {self.src}")
        return sw.wall, sw.cpu

    def write(self) -> tuple[float, float]:
        handle = self._create_destination()  # replaces the previous run's array, untimed
        with Stopwatch() as sw:
            self._write_from(handle)
        return sw.wall, sw.cpu

    def cleanup(self) -> None:
        shutil.rmtree(self.dst, ignore_errors=True)


class ZarrPythonBench(_PeerBench):
    name = "zarr_python"

    def __init__(self, *a):
        import zarr
        from zarr.core.buffer.cpu import NDBuffer

        self.zarr, self.NDBuffer = zarr, NDBuffer
        super().__init__(*a)

    def describe(self) -> str:
        cfg = self.zarr.config
        return (f"zarr-python {self.zarr.__version__} defaults (async.concurrency="
                f"{cfg.get('async.concurrency')}); read: get_basic_selection(out=) of the whole "
                f"array; write: create_array(compressors=None) then arr[:] = data, then "
                f"fdatasync of every file")

    def _open_source(self):
        return self.zarr.open_array(self.src, mode="r")

    def _read_into(self, arr) -> None:
        arr.get_basic_selection(slice(None), out=self.NDBuffer.from_numpy_array(self.host))

    def _create_destination(self):
        return self.zarr.create_array(
            store=self.dst, shape=(self.numel,), chunks=(self.chunk_elems,), dtype="float32",
            compressors=None, filters=None, fill_value=0.0, dimension_names=["element"],
            config={"write_empty_chunks": True}, overwrite=True)

    def _write_from(self, arr) -> None:
        arr[:] = self.host
        sync_tree(self.dst)  # zarr-python writes through the page cache and never syncs


class TensorstoreBench(_PeerBench):
    name = "tensorstore"

    def __init__(self, *a):
        import tensorstore

        self.ts = tensorstore
        super().__init__(*a)

    def describe(self) -> str:
        from importlib.metadata import version

        return (f"tensorstore {version('tensorstore')} zarr3 driver, file kvstore, default "
                f"context (file_io_sync on); read: ts.array(out).write(store) of the whole "
                f"array; write: store.write(data), uncompressed")

    def _spec(self, path: str) -> dict:
        return {"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}

    def _open_source(self):
        return self.ts.open(self._spec(self.src), open=True, read=True).result()

    def _read_into(self, store) -> None:
        self.ts.array(self.host, write=True, copy=False).write(store).result()

    def _create_destination(self):
        spec = self._spec(self.dst)
        spec["metadata"] = {
            "shape": [self.numel], "data_type": "float32", "fill_value": 0.0,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [self.chunk_elems]}},
            "chunk_key_encoding": {"name": "default"},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
            "dimension_names": ["element"],
        }
        return self.ts.open(spec, create=True, delete_existing=True).result()

    def _write_from(self, store) -> None:
        store.write(self.host).result()


class Stopwatch:
    """Wall seconds and CPU seconds (user + system, every thread of this process and its
    waited-for children) of a ``with`` block."""

    def __enter__(self) -> "Stopwatch":
        self._cpu0 = _cpu_seconds()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self._t0
        self.cpu = _cpu_seconds() - self._cpu0


def _cpu_seconds() -> float:
    import resource

    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
