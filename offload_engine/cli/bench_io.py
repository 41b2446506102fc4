"""`offload-engine bench io`: the engine's disk throughput against fio, zarr-python and tensorstore.

Each run writes SIZE bytes and reads them back with every method, the page cache evicted
(fdatasync, then posix_fadvise DONTNEED, then a mincore check) before every read:

- engine: a 1-D float32 ``FlatArray`` (zarr v3, CHUNK bytes per chunk file) written from and
  read into a ring of reusable ``BufferPool`` buffers through ``AsyncFileIO`` with the
  settings the store would use: per direction the device profile's mode, queue depth,
  block size and streams (io/device_profile.py; probed once and cached), unless
  ``--read-mode``, ``--write-mode``, ``--queue-depth``, ``--block-size`` or ``--streams``
  say otherwise; the ring holds enough chunks that every stream has one to serve. The array is
  created and preallocated once, untimed (as fio lays out its file before it starts); each
  write run overwrites it in place and its time includes ``fdatasync`` of every chunk file.
- fio (``--ioengine=libaio --direct=1``, the engine's block size and queue depth of that
  direction, with the engine's streams as that many jobs each on its own part of the file
  at queue depth / streams, ``--end_fsync=1`` on writes, which fio counts in its runtime)
  on one file of SIZE bytes, and fio buffered (``--ioengine=psync --direct=0``, same block size, the page
  cache evicted before reads, ``--end_fsync=1`` on writes); where fio is not installed,
  ``odirect_loop``: ``os.pwritev``/``os.preadv`` in QD threads on one O_DIRECT
  descriptor, with aligned mmap buffers.
- zarr_python / tensorstore: each reads the engine's array whole into one preallocated,
  pre-faulted host array, with the library's default settings. The write column writes a
  new uncompressed array of the same shape and chunking from that host array
  (zarr-python: plus ``fdatasync`` of every file, since it does not sync; tensorstore syncs
  each chunk by default).

Every method first writes its files once, untimed, so that each timed write overwrites
written blocks (as the store does every step). Runs are interleaved: in run 1 every method
writes, then every method reads, then run 2 follows; each method goes first once in every
so many runs as there are methods, and the others follow in an order that changes from
run to run (``run_order``), so drift in a noisy disk and one method's after-effects hit
every method alike. Figures are GB/s (1e9 bytes per second); the medians of the runs
are reported, with every run's value, the best peer per direction (fastest median of fio,
fio buffered, zarr-python and tensorstore) and the engine's ratio to it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import mmap
import os
import platform
import shutil
import stat
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import numpy as np

from ..io import ALIGN, AsyncFileIO
from ..layout import FlatArray
from .args import byte_size, positive_int
from .progress import ByteCounter, ProgressLine, wanted
from ..units import MiB, format_bytes, parse_bytes
from .bench_io_methods import (ITEMSIZE, BenchError, EngineBench, FioBench, ODirectLoopBench,
                               TensorstoreBench, ZarrPythonBench, fill_pattern, probe_direct)

SPACE_MARGIN = 64 * MiB  # disk kept free beyond the test files
PEERS = ("zarr_python", "tensorstore")


@dataclass
class BenchConfig:
    path: str
    size: int = 2 << 30
    block_size: int | None = None  # None: the device profile's, per direction
    queue_depth: int | None = None
    streams: int | None = None  # None: the device profile's, per direction
    chunk_size: int = 64 * MiB
    runs: int = 3
    baseline: str = "auto"  # "auto" | "fio" | "odirect_loop"
    keep: bool = False
    read_mode: str = "auto"  # "auto" (the profile's) | "direct" | "buffered"
    write_mode: str = "auto"


@dataclass
class MethodResult:
    notes: str = ""
    skipped: str | None = None
    resident: int = 0  # most bytes found in the page cache right before a read
    write_runs: list[float] = field(default_factory=list)  # GB/s
    read_runs: list[float] = field(default_factory=list)
    write_cpu: list[float] = field(default_factory=list)  # CPU seconds
    read_cpu: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        out = {"write_gbps": _median(self.write_runs), "read_gbps": _median(self.read_runs),
               "write_runs": [round(x, 3) for x in self.write_runs],
               "read_runs": [round(x, 3) for x in self.read_runs],
               "write_cpu_s": _median(self.write_cpu), "read_cpu_s": _median(self.read_cpu),
               "cached_before_read_bytes": self.resident, "notes": self.notes}
        if self.skipped is not None:
            out["skipped"] = self.skipped
        return out


# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser, *, size_default: str = "2GiB",
                  runs_default: int = 3) -> None:
    p.add_argument("--path", required=True, metavar="DIR",
                   help="existing directory on the disk to measure; a temporary folder is "
                        "made in it and removed afterwards")
    p.add_argument("--size", default=parse_bytes(size_default), type=byte_size,
                   help=f"bytes moved per run and method (default {size_default})")
    p.add_argument("--block-size", default=None, type=byte_size,
                   help="bytes per I/O request, a multiple of 4096 (default: the device "
                        "profile's, per direction)")
    p.add_argument("--queue-depth", default=None, type=positive_int, metavar="N",
                   help="requests in flight (default: the device profile's, per direction)")
    p.add_argument("--streams", default=None, type=positive_int, metavar="N",
                   help="requests (chunk files) served at once, one piece from each in turn "
                        "(default: the device profile's, per direction)")
    p.add_argument("--read-mode", choices=("auto", "direct", "buffered"), default="auto",
                   help="engine reads: O_DIRECT, buffered, or the profile's choice (auto)")
    p.add_argument("--write-mode", choices=("auto", "direct", "buffered"), default="auto",
                   help="engine writes: O_DIRECT, buffered, or the profile's choice (auto)")
    p.add_argument("--chunk-size", default=64 * MiB, type=byte_size,
                   help="bytes per chunk file of the zarr array (default 64MiB)")
    p.add_argument("--runs", default=runs_default, type=positive_int,
                   help=f"runs per method; medians are reported (default {runs_default})")
    p.add_argument("--baseline", choices=("auto", "fio", "odirect_loop"), default="auto",
                   help="device reference: fio when installed (auto), or a plain O_DIRECT "
                        "loop in Python")
    p.add_argument("--keep", action="store_true",
                   help="leave the benchmark folder (engine array, baseline file) in DIR")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "io", help="disk throughput: engine vs fio, zarr-python and tensorstore",
        description="Write SIZE bytes through the engine (fsync counted) and read them back "
                    "with the page cache evicted, with the I/O settings the store would use "
                    "(the device profile's unless flags say otherwise); move the same bytes "
                    "with fio O_DIRECT at the same block size, queue depth and streams and "
                    "with fio buffered; read the same zarr array with zarr-python and tensorstore. "
                    "Prints median GB/s per method, the best peer per direction and the "
                    "engine's ratios.")
    add_arguments(p)
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    bar = ProgressLine(label="bench io") if wanted(args) else None
    try:
        result = run_benchmark(config_from_args(args), progress=_progress(args, bar), moved=bar)
    finally:
        if bar is not None:
            bar.close()
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


def config_from_args(args: argparse.Namespace, **overrides) -> BenchConfig:
    values = dict(path=args.path, size=args.size, block_size=args.block_size,
                  queue_depth=args.queue_depth, streams=getattr(args, "streams", None),
                  chunk_size=args.chunk_size, runs=args.runs,
                  baseline=getattr(args, "baseline", "auto"), keep=getattr(args, "keep", False),
                  read_mode=getattr(args, "read_mode", "auto"),
                  write_mode=getattr(args, "write_mode", "auto"))
    values.update(overrides)
    return BenchConfig(**values)


def _progress(args, bar=None):
    """With --debug, each measurement's line on stderr (above the bar where one is drawn)."""
    if not getattr(args, "debug", False):
        return None
    return bar.write if bar is not None else lambda line: print(line, file=sys.stderr, flush=True)




# --------------------------------------------------------------------------------------------
# the benchmark
# --------------------------------------------------------------------------------------------
def run_benchmark(cfg: BenchConfig, progress=None, moved=None) -> dict:
    """Run every method ``cfg.runs`` times; returns the JSON-ready result.

    ``progress``: optional callable taking one line of text per measurement; ``moved``:
    optional ``moved(done, total)``, the bytes written and read so far (warm-up included)
    of all the benchmark moves.
    """
    say = progress or (lambda line: None)
    check_config(cfg)
    baseline = _choose_baseline(cfg.baseline)
    # the engine array, the baseline files, the zarr-python and the tensorstore arrays
    workdir = make_workdir(cfg.path, 5 if baseline == "fio" else 4, cfg.size)
    try:
        settings, report = engine_settings(cfg)
        return _run_in(cfg, settings, report, baseline, workdir, say, moved)
    finally:
        if cfg.keep:
            say(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def check_config(cfg: BenchConfig) -> None:
    """Validate the sizes and counts given (None: the profile's, checked later)."""
    for name, value in (("--size", cfg.size), ("--block-size", cfg.block_size),
                        ("--chunk-size", cfg.chunk_size)):
        if value is not None and (value <= 0 or value % ALIGN):
            raise BenchError(f"{name} must be a positive multiple of {ALIGN} bytes, got {value}")
    if cfg.block_size is not None and cfg.size % min(cfg.block_size, cfg.size):
        raise BenchError(f"--size ({cfg.size} bytes) must be a multiple of --block-size "
                         f"({cfg.block_size} bytes)")
    if cfg.runs < 1 or (cfg.queue_depth is not None and cfg.queue_depth < 1):
        raise BenchError("--runs and --queue-depth must be at least 1")
    if cfg.streams is not None and not 1 <= cfg.streams <= 64:
        raise BenchError(f"--streams must be between 1 and 64, got {cfg.streams}")


def engine_settings(cfg: BenchConfig) -> tuple[dict, dict]:
    """The engine's settings per direction, chosen as the store chooses them (flags where
    given, else the device profile of ``cfg.path``, else the defaults), blocks capped at
    SIZE; and the report of where each came from."""
    from ..store.config import StoreConfig
    from ..store.io_choice import resolve

    given = {"nvme_paths": [cfg.path], "read_mode": cfg.read_mode,
             "write_mode": cfg.write_mode, "adaptive_io": False}
    if cfg.queue_depth is not None:
        given["queue_depth"] = cfg.queue_depth
    if cfg.block_size is not None:
        given["block_size"] = cfg.block_size
    if cfg.streams is not None:
        given["io_streams"] = cfg.streams
    choice = resolve(StoreConfig(**given), os.path.abspath(cfg.path))
    out = {}
    for op in ("read", "write"):
        st = choice[op]
        block = min(st.block_bytes, cfg.size)
        while cfg.size % block:  # a profile's block that does not divide SIZE: halve it
            block //= 2
        out[op] = st.with_(block_bytes=max(block, ALIGN))
    report = choice["report"]
    for op in ("read", "write"):
        report[op]["block_bytes"] = out[op].block_bytes
    return out, report


def make_workdir(path: str, files: int, size: int) -> str:
    """A new temporary folder in ``path``, after checking it is a directory with room for
    ``files`` files of ``size`` bytes (plus a margin). Raises BenchError with one line
    otherwise."""
    where = os.path.abspath(path)
    try:
        st = os.stat(where)
    except OSError as e:
        raise BenchError(f"{path}: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise BenchError(f"{path}: not a directory")
    need = files * size + SPACE_MARGIN
    free = shutil.disk_usage(where).free
    if free < need:
        raise BenchError(f"{path}: {format_bytes(free)} free; the benchmark needs "
                         f"{format_bytes(need)} ({files} x --size plus "
                         f"{format_bytes(SPACE_MARGIN)})")
    try:
        return tempfile.mkdtemp(prefix="offload-engine-bench-", dir=where)
    except OSError as e:
        raise BenchError(f"{path}: cannot create a folder there: {e.strerror or e}") from None


def _choose_baseline(choice: str) -> str:
    if choice == "odirect_loop":
        return "odirect_loop"
    if shutil.which("fio"):
        return "fio"
    if choice == "fio":
        raise BenchError("--baseline fio: fio is not installed (apt-get install fio); "
                         "or use --baseline odirect_loop")
    return "odirect_loop"


def _run_in(cfg: BenchConfig, settings: dict, report: dict, baseline: str, workdir: str,
            say, moved=None) -> dict:
    import torch

    rd, wr = settings["read"], settings["write"]
    qd, block_size = rd.queue_depth, rd.block_bytes  # the peers' (fio, loop) read settings
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = _loadavg()
    direct_ok = probe_direct(workdir)
    results: dict[str, MethodResult] = {}
    notes: list[str] = []
    threads = max(rd.queue_depth, wr.queue_depth)
    io = AsyncFileIO(threads=threads, read=rd, write=wr)
    engine = None
    try:
        # -- setup, untimed: engine array created and preallocated, buffers filled ----------
        array = FlatArray.create(os.path.join(workdir, "engine.zarr"), cfg.size // ITEMSIZE,
                                 torch.float32, io=io, chunk_bytes=cfg.chunk_size,
                                 preallocate=True,
                                 attributes={"written_by": "offload-engine bench io"})
        engine = EngineBench(array, io, io.block_size)
        benches = [("engine", engine)]
        if baseline == "fio":
            base = FioBench(os.path.join(workdir, "fio.dat"), cfg.size,
                            {"read": (rd.block_bytes, rd.queue_depth, rd.streams),
                             "write": (wr.block_bytes, wr.queue_depth, wr.streams)}, direct_ok)
            benches.append((baseline, base))
            benches.append(("fio_buffered", FioBench(
                os.path.join(workdir, "fio_buffered.dat"), cfg.size,
                {"read": (rd.block_bytes, 1, 1), "write": (wr.block_bytes, 1, 1)}, False)))
        else:
            base = ODirectLoopBench(os.path.join(workdir, "odirect_loop.dat"), cfg.size,
                                    block_size, qd, direct_ok)
            benches.append((baseline, base))
        host, why = _host_array(cfg.size)
        for name, cls in (("zarr_python", ZarrPythonBench), ("tensorstore", TensorstoreBench)):
            if host is None:
                results[name] = MethodResult(skipped=why)
                continue
            try:
                benches.append((name, cls(array, workdir, host, engine.expected_chunk)))
            except ImportError as e:
                results[name] = MethodResult(skipped=f"not installed ({e})")
        for name, bench in benches:
            results[name] = MethodResult(notes=bench.describe())

        # -- warm-up, untimed: every method writes its files once, so each timed write
        # overwrites blocks already written, as every step of a training run does (the
        # first write into new or preallocated extents also pays for the file system's
        # allocation, in whichever run came first) --
        count = ByteCounter(moved, cfg.size * len(benches) * (1 + 2 * cfg.runs))
        for name, bench in benches:
            bench.write()
            count(cfg.size)
            say(f"warm-up {name} write (untimed)")
        engine.direct_pieces = engine.buffered_pieces = 0  # count the timed runs' pieces only

        # -- timed runs: in each run every method writes, then every method reads (so each
        # read finds data written a while before, never just now), in run_order --
        for r in range(cfg.runs):
            order = [benches[i] for i in run_order(len(benches), r)]
            for column in ("write", "read"):
                for name, bench in order:
                    wall, cpu = getattr(bench, column)()
                    count(cfg.size)
                    gbps = cfg.size / wall / 1e9
                    getattr(results[name], f"{column}_runs").append(gbps)
                    getattr(results[name], f"{column}_cpu").append(cpu)
                    say(f"run {r + 1}/{cfg.runs} {name} {column}: {gbps:.3f} GB/s, "
                        f"{cpu:.2f} CPU s")
        for name, bench in benches:
            results[name].resident = bench.resident
            bench.cleanup()
            if bench.resident:
                notes.append(f"{name}: {bench.resident} bytes were still in the page cache "
                             f"before a read (eviction incomplete)")

        engine_direct = bool(io.uses_direct(array.chunk_path(0)))
        if not io.uses_direct(array.chunk_path(0)) and direct_ok:
            notes.append("the engine ran buffered in both directions (its settings' choice), "
                         "page cache evicted before each read")
        elif not engine_direct:
            notes.append("O_DIRECT was not in effect for the engine: buffered I/O, page "
                         "cache evicted before each read")
        if not direct_ok:
            notes.append("the file system refuses O_DIRECT: the baseline ran buffered, page "
                         "cache evicted before each read")
        return {
            "size_bytes": cfg.size,
            "block_size": block_size,
            "queue_depth": qd,
            "chunk_bytes": array.chunk_bytes,
            "runs": cfg.runs,
            "direct": engine_direct,
            "baseline": baseline,
            "fio_args": base.args if baseline == "fio" else None,
            "methods": {name: results[name].as_dict()
                        for name in ("engine", baseline, "fio_buffered", *PEERS)
                        if name in results},
            "ratios": _ratios(results, baseline),
            "best_peer": _best_peers(results, baseline),
            "cpu_ratios": _cpu_ratios(results),
            "io": report,
            "engine": {
                "threads": threads,
                "ring_buffers": engine.nslots,
                "ring_bytes": engine.nslots * array.chunk_bytes,
                "direct_pieces": engine.direct_pieces,
                "buffered_pieces": engine.buffered_pieces,
            },
            "environment": _environment(workdir, baseline, started, load_before),
            "notes": notes,
        }
    finally:
        io.close()  # first: its worker threads may still hold views of the ring's buffers
        if engine is not None:
            engine.close()


def run_order(methods: int, run: int) -> list[int]:
    """The order (indices) in which ``methods`` methods go in run ``run`` (from 0).

    Method ``run % methods`` goes first, so over any ``methods`` runs each goes first once
    (the first write after a read phase can find the disk in a different state); the
    rest follow at a stride coprime with ``methods`` that changes from run to run, so a
    method's predecessor changes too and no method's figures always carry over the same
    peer's (a plain rotation always puts one method right after the same other one).
    """
    strides = [k for k in range(1, methods) if math.gcd(k, methods) == 1] or [1]
    stride = strides[run % len(strides)]
    return [(run + i * stride) % methods for i in range(methods)]


def _ratios(results: dict[str, MethodResult], baseline: str) -> dict:
    def ratio(other: str, column: str):
        a = _median(getattr(results["engine"], f"{column}_runs"))
        o = results.get(other)
        b = _median(getattr(o, f"{column}_runs")) if o is not None else None
        return round(a / b, 3) if a and b else None

    return {
        f"engine_vs_{baseline}_write": ratio(baseline, "write"),
        f"engine_vs_{baseline}_read": ratio(baseline, "read"),
        "engine_vs_zarr_python_read": ratio("zarr_python", "read"),
        "engine_vs_tensorstore_read": ratio("tensorstore", "read"),
        "engine_vs_zarr_python_write": ratio("zarr_python", "write"),
        "engine_vs_tensorstore_write": ratio("tensorstore", "write"),
    }


def _best_peers(results: dict[str, MethodResult], baseline: str) -> dict:
    """Per direction, the fastest peer (median GB/s) and the engine's ratio to it."""
    out = {}
    for column in ("read", "write"):
        peers = [(name, _median(getattr(results[name], f"{column}_runs")))
                 for name in (baseline, "fio_buffered", *PEERS) if name in results]
        peers = [(n, g) for n, g in peers if g]
        engine = _median(getattr(results["engine"], f"{column}_runs"))
        if not peers or not engine:
            out[column] = None
            continue
        name, gbps = max(peers, key=lambda t: t[1])
        out[column] = {"method": name, "gbps": gbps, "engine_gbps": engine,
                       "engine_vs_best": round(engine / gbps, 3)}
    return out


def _cpu_ratios(results: dict[str, MethodResult]) -> dict:
    """Engine CPU seconds over each library peer's, per direction (below 1: engine cheaper)."""
    out = {}
    for name in PEERS:
        for column in ("read", "write"):
            a = _median(getattr(results["engine"], f"{column}_cpu"))
            o = results.get(name)
            b = _median(getattr(o, f"{column}_cpu")) if o is not None else None
            out[f"engine_vs_{name}_{column}"] = round(a / b, 3) if a is not None and b else None
    return out


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _host_array(nbytes: int):
    """A page-aligned float32 host array of ``nbytes``, every page touched (page faults are
    not timed) and filled with non-zero bytes; (None, reason) when memory is short."""
    try:
        import psutil

        avail = psutil.virtual_memory().available
    except Exception:  # psutil absent or /proc unreadable: try anyway
        avail = None
    if avail is not None and nbytes > 0.75 * avail:
        return None, (f"reading the array whole needs {format_bytes(nbytes)} of host memory; "
                      f"{format_bytes(avail)} available (use a smaller --size)")
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    host = np.frombuffer(region, dtype=np.float32)
    fill_pattern(host.view(np.uint8), seed=1 << 20)
    return host, None


# --------------------------------------------------------------------------------------------
# environment and output
# --------------------------------------------------------------------------------------------
def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _filesystem(path: str) -> str | None:
    """File system type and device of the mount holding ``path`` (from /proc/mounts)."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    real = os.path.realpath(path)
    best = None
    for dev, mnt, fstype, *_ in mounts:
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and \
                (best is None or len(mnt) > len(best[1])):
            best = (dev, mnt, fstype)
    return f"{best[2]} on {best[0]} (mounted at {best[1]})" if best else None


def _environment(workdir: str, baseline: str, started, load_before) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def pkg(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    fio_version = None
    if baseline == "fio":
        try:
            fio_version = subprocess.run(["fio", "--version"], capture_output=True,
                                         text=True).stdout.strip()
        except OSError:
            pass
    return {
        "date": started.isoformat(timespec="seconds"),
        "path": os.path.dirname(workdir),
        "filesystem": _filesystem(workdir),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
        "python": platform.python_version(),
        "versions": {"offload-engine": pkg("offload-engine"), "zarr": pkg("zarr"),
                     "tensorstore": pkg("tensorstore"), "numpy": pkg("numpy"),
                     "fio": fio_version},
    }


def format_table(result: dict) -> str:
    """The human-readable report of ``run_benchmark``'s result."""
    env = result["environment"]
    lines = [
        f"I/O benchmark in {env['path']}: {format_bytes(result['size_bytes'])} per run, "
        f"block {format_bytes(result['block_size'])}, queue depth {result['queue_depth']}, "
        f"chunk {format_bytes(result['chunk_bytes'])}, {result['runs']} run(s), medians; "
        f"O_DIRECT {'on' if result['direct'] else 'off'}",
        "",
        f"{'method':<14}{'write GB/s':>11}{'read GB/s':>11}{'CPU s w/r':>13}   "
        f"runs GB/s (write | read)",
    ]

    def num(x):
        return f"{x:.3f}" if x is not None else "-"

    for name, m in result["methods"].items():
        if m.get("skipped"):
            lines.append(f"{name:<14}{'-':>11}{'-':>11}{'-':>13}   skipped: {m['skipped']}")
            continue
        runs = " ".join(num(x) for x in m["write_runs"]) + " | " + \
            " ".join(num(x) for x in m["read_runs"])
        cpu = f"{m['write_cpu_s']:.2f}/{m['read_cpu_s']:.2f}"
        lines.append(f"{name:<14}{num(m['write_gbps']):>11}{num(m['read_gbps']):>11}"
                     f"{cpu:>13}   {runs}")
    lines.append("")
    lines.append("engine / other (above 1: engine faster):")
    for key, value in result["ratios"].items():
        label = key.removeprefix("engine_vs_").rsplit("_", 1)
        lines.append(f"  {label[0]:<13} {label[1]:<6} {('%.2fx' % value) if value else '-'}")
    for column in ("read", "write"):
        best = result.get("best_peer", {}).get(column)
        if best:
            lines.append(f"  best peer {column}: {best['method']} {best['gbps']:.3f} GB/s; "
                         f"engine {best['engine_vs_best']:.2f}x")
    io = result.get("io") or {}
    for column in ("read", "write"):
        if column in io:
            st = io[column]
            lines.append(f"engine {column}: {st['mode']}, queue depth {st['queue_depth']}, "
                         f"block {format_bytes(st['block_bytes'])}, {st.get('streams', 1)} "
                         f"stream(s) (from {st['source']})")
    if result["fio_args"]:
        lines.append("")
        for rw in ("write", "read"):
            lines.append(f"fio {rw}: " + " ".join(result["fio_args"][rw]))
    for note in result["notes"]:
        lines.append(f"note: {note}")
    lines.append(f"load average before/after: {env['loadavg_before']} / {env['loadavg_after']}")
    return "\n".join(lines)
