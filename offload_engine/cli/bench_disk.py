"""`offload-engine bench disk`: tune the engine's I/O settings for one disk, and remember them.

Like DeepSpeed's ``ds_nvme_tune`` does for its aio engine, this sweeps block size x queue
depth (x threads) for reads and writes, but through the engine's own path: ``AsyncFileIO``
(the thread pool the store uses, O_DIRECT where the file system takes it) moving a
preallocated file in bucket-sized requests from a page-aligned ``BufferPool`` buffer.

- Writes overwrite the file in place and include ``fdatasync``; before every read the page
  cache is evicted (fdatasync, posix_fadvise DONTNEED) and checked empty (mincore).
- Every request is ``--request-size`` bytes (the store's default bucket, 64 MiB), all
  submitted at once, as the store's prefetch and write-behind do; ``AsyncFileIO`` keeps
  ``queue_depth`` pieces of ``block_size`` in flight on ``threads`` threads.
- Threads equal the queue depth unless ``--threads`` lists others (the device sees
  ``min(threads, queue_depth)`` requests).
- The best point is the one that reads and writes the same bytes fastest (least
  ``1/read + 1/write``: every step reads and writes each bucket once). It is saved per device
  (see ``plan/disk_profile.py``) and ``offload-engine plan --nvme DIR`` uses it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from ..io import AsyncFileIO, BufferPool
from ..io.page_cache import evict_and_check
from ..plan import disk_profile
from .args import aligned_size, positive_int
from .progress import ByteCounter, ProgressLine, wanted
from ..units import MiB, format_bytes
from ..errors import InputError
FULL = {"block_sizes": [1 * MiB, 4 * MiB, 8 * MiB, 16 * MiB], "queue_depths": [1, 4, 8, 16, 32],
        "size": 256 * MiB, "repeats": 2}
QUICK = {"block_sizes": [1 * MiB, 8 * MiB], "queue_depths": [1, 4, 16], "size": 64 * MiB,
         "repeats": 1}


class DiskBenchError(InputError):
    """Bad directory, sizes or lists: one line, exit code 2."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "disk", help="sweep block size, queue depth and threads on a disk; cache the best",
        description="Sweep block size x queue depth (x threads) for reads and writes through "
                    "the engine's own I/O path on a preallocated file under DIR (page cache "
                    "evicted before reads, fdatasync counted in writes), print a table, and "
                    "cache the best settings for DIR's device, where `offload-engine plan "
                    "--nvme DIR` finds them.")
    p.add_argument("--path", required=True, metavar="DIR",
                   help="existing directory on the disk to measure (a temporary folder is "
                        "made in it and removed)")
    p.add_argument("--quick", action="store_true",
                   help="fewer points (block 1,8 MiB x depth 1,4,16) on a 64 MiB file, one run")
    p.add_argument("--size", type=aligned_size, default=None,
                   help="bytes of the test file (default 256MiB, 64MiB with --quick)")
    p.add_argument("--block-sizes", type=_size_list, default=None, metavar="LIST",
                   help="comma-separated block sizes (default 1MiB,4MiB,8MiB,16MiB)")
    p.add_argument("--queue-depths", type=_int_list, default=None, metavar="LIST",
                   help="comma-separated queue depths (default 1,4,8,16,32)")
    p.add_argument("--threads", type=_int_list, default=None, metavar="LIST",
                   help="comma-separated I/O thread counts (default: equal to the queue depth)")
    p.add_argument("--request-size", type=aligned_size, default=64 * MiB,
                   help="bytes per request, like one store bucket (default 64MiB)")
    p.add_argument("--repeats", type=positive_int, default=None,
                   help="runs per point, median kept (default 2, 1 with --quick)")
    p.add_argument("--no-cache", action="store_true", help="do not save the result")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--deepspeed-aio", action="store_true",
                   help="print only the best point as a DeepSpeed \"aio\" config block")
    p.add_argument("--refresh-profile", action="store_true",
                   help="instead of the sweep, probe DIR's I/O profile again (direct and "
                        "buffered, a few seconds) and replace the cached one that the "
                        "store, consolidate, inspect --stats and bench io use")
    p.set_defaults(run=run)
    return p



def _size_list(text: str) -> list[int]:
    return [aligned_size(t) for t in text.split(",") if t.strip()]



def _int_list(text: str) -> list[int]:
    return [positive_int(t) for t in text.split(",") if t.strip()]


def settings(args) -> dict:
    base = QUICK if args.quick else FULL
    return {"size": args.size or base["size"],
            "block_sizes": args.block_sizes or base["block_sizes"],
            "queue_depths": args.queue_depths or base["queue_depths"],
            "threads": args.threads, "request_size": args.request_size,
            "repeats": args.repeats or base["repeats"], "quick": bool(args.quick)}


def run(args) -> int:
    if args.refresh_profile:
        return refresh_profile(args)
    cfg = settings(args)
    bar = ProgressLine(label="bench disk") if wanted(args) else None
    say = (lambda m: None) if args.json else bar.write if bar else (
        lambda m: print(m, file=sys.stderr, flush=True))
    try:
        result = sweep(args.path, say=say, progress=bar, **cfg)
    finally:
        if bar is not None:
            bar.close()
    if not args.no_cache:
        result["cache_file"] = disk_profile.save_profile(args.path, result)
    if args.deepspeed_aio:
        print(json.dumps({"aio": deepspeed_aio(result["best"])}, indent=2))
    elif args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result))
        return 0
    if result.get("cache_file"):  # stdout holds JSON: where it was saved goes to stderr
        print(f"offload-engine bench disk: {saved_line(result)}", file=sys.stderr)
    return 0


def saved_line(result: dict) -> str:
    """Where the best settings were saved, who reads them, and how not to save them."""
    return (f"saved to {result['cache_file']} (used by `offload-engine plan --nvme "
            f"{result['path']}`; --no-cache: do not save)")


def refresh_profile(args) -> int:
    """Probe the device profile of ``args.path`` again, cache it, print what it chose."""
    from ..io import device_profile

    if not os.path.isdir(args.path):
        raise DiskBenchError(f"{args.path}: not an existing directory")
    if not os.access(args.path, os.W_OK):
        raise DiskBenchError(f"{args.path}: directory is not writable")
    bar = ProgressLine(label="probe") if wanted(args) else None
    try:
        prof = device_profile.choose(args.path, refresh=True, probe_allowed=True, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    if prof["source"] != "probe":
        raise DiskBenchError(f"{args.path}: the probe failed (see the warning above); "
                             "nothing was cached")
    if args.json:
        print(json.dumps(prof, indent=2))
        return 0
    lines = [f"I/O profile of {args.path} ({prof['key']['fs_type']} on device "
             f"{prof['key']['dev']}, mounted at {prof['key']['mount']}): "
             f"{format_bytes(prof['bytes_per_case'])} per case, {prof['probe_s']:.1f} s",
             f"{'mode':>9} {'depth':>6} {'block':>10} {'streams':>8} {'write GB/s':>11} "
             f"{'read GB/s':>10}"]
    for p in prof["points"]:
        lines.append(f"{p['mode']:>9} {p['queue_depth']:>6} {format_bytes(p['block_bytes']):>10} "
                     f"{p.get('streams', 1):>8} {p['write_gbps']:>11.2f} {p['read_gbps']:>10.2f}")
    for op in ("read", "write"):
        c = prof[op]
        lines.append(f"{op}: {c['mode']}, queue depth {c['queue_depth']}, block "
                     f"{format_bytes(c['block_bytes'])}, {c.get('streams', 1)} stream(s) "
                     f"({c['gbps']:.2f} GB/s)")
    lines.append(f"saved to {prof['file']}" if prof.get("file") else
                 "not saved: the cache directory is not writable")
    print("\n".join(lines))
    return 0


def deepspeed_aio(best: dict) -> dict:
    """The best point as DeepSpeed's ``aio`` block: the same block size and the same
    requests in flight (DeepSpeed keeps ``queue_depth`` per thread on
    ``intra_op_parallelism`` threads; our point had ``min(queue_depth, io_threads)`` in
    flight). ``config from-deepspeed`` maps it back to the same point."""
    return {"block_size": best["block_size"],
            "queue_depth": min(best["queue_depth"], best["io_threads"]),
            "intra_op_parallelism": 1, "single_submit": False, "overlap_events": True,
            "use_gds": False}


def sweep(path: str, *, size: int, block_sizes: list[int], queue_depths: list[int],
          threads: list[int] | None, request_size: int, repeats: int, quick: bool = False,
          say=lambda m: None, progress=None) -> dict:
    """Measure every point; returns the points, the best one and what was measured.
    ``progress(done, total)``: bytes moved by the timed runs so far, of all of them."""
    if not os.path.isdir(path):
        raise DiskBenchError(f"{path}: not an existing directory")
    if not os.access(path, os.W_OK):
        raise DiskBenchError(f"{path}: directory is not writable")
    request = min(request_size, size)
    free = shutil.disk_usage(path).free
    if free < size + 64 * MiB:
        raise DiskBenchError(f"{path}: {format_bytes(free)} free, the sweep needs "
                             f"{format_bytes(size + 64 * MiB)}")
    blocks = sorted({min(b, request) for b in block_sizes})
    workdir = tempfile.mkdtemp(prefix="oe-bench-disk-", dir=path)
    file = os.path.join(workdir, "data")
    points, direct, cached = [], None, 0
    runs = len(blocks) * len(queue_depths) * len(threads or [None]) * repeats
    moved = ByteCounter(progress, 2 * size * runs)
    t_start = time.monotonic()
    pool = BufferPool(request, pin=False)
    try:
        buf = pool.acquire(request)
        pattern = np.frombuffer(os.urandom(4096), dtype=np.uint8)
        buf.bytes.numpy().reshape(-1, 4096)[:] = pattern  # not zeros: no shortcuts
        with AsyncFileIO(threads=1, queue_depth=1, block_size=4096) as io0:
            io0.preallocate(file, size)
        for bs in blocks:
            for qd in queue_depths:
                for th in (threads or [qd]):
                    w, r = [], []
                    with AsyncFileIO(threads=th, queue_depth=qd, block_size=bs) as io:
                        for _ in range(repeats):
                            w.append(_timed(io, file, buf, size, request, write=True))
                            moved(size)
                            cached = max(cached, evict_and_check([file]))
                            r.append(_timed(io, file, buf, size, request, write=False))
                            moved(size)
                        direct = io.uses_direct(file) if direct is None else (direct and io.uses_direct(file))
                    pt = {"block_size": bs, "queue_depth": qd, "io_threads": th,
                          "write_gbps": round(size / statistics.median(w) / 1e9, 4),
                          "read_gbps": round(size / statistics.median(r) / 1e9, 4),
                          "write_runs_s": [round(x, 4) for x in w],
                          "read_runs_s": [round(x, 4) for x in r]}
                    points.append(pt)
                    say(f"block {format_bytes(bs)}, depth {qd}, threads {th}: "
                        f"write {pt['write_gbps']:.2f} GB/s, read {pt['read_gbps']:.2f} GB/s")
        buf.release()
    finally:
        pool.close()
        shutil.rmtree(workdir, ignore_errors=True)
    best = min(points, key=lambda p: (1 / p["write_gbps"] + 1 / p["read_gbps"],
                                      p["queue_depth"], p["block_size"]))
    notes = []
    if not direct:
        notes.append("O_DIRECT was not in effect (the file system refused it): figures may "
                     "include the page cache")
    if cached:
        notes.append(f"{cached} bytes were still cached before a read")
    return {"path": os.path.abspath(path), "size_bytes": size, "request_bytes": request,
            "repeats": repeats, "quick": quick, "direct": bool(direct),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "sweep_s": round(time.monotonic() - t_start, 2),
            "best": {k: best[k] for k in ("block_size", "queue_depth", "io_threads",
                                          "read_gbps", "write_gbps")},
            "points": points, "notes": notes}


def _timed(io: AsyncFileIO, file: str, buf, size: int, request: int, write: bool) -> float:
    t0 = time.perf_counter()
    futures = []
    for off in range(0, size, request):
        n = min(request, size - off)
        futures.append(io.write(file, off, buf, length=n) if write else io.read(file, off, buf, length=n))
    for f in futures:
        f.result()
    if write:
        io.sync(file).result()
    return time.perf_counter() - t0


def format_table(result: dict) -> str:
    lines = [f"bench disk: {result['path']} ({format_bytes(result['size_bytes'])} file, requests "
             f"of {format_bytes(result['request_bytes'])}, O_DIRECT "
             f"{'on' if result['direct'] else 'off'}, {result['repeats']} run(s) per point, "
             f"{result['sweep_s']:.1f} s)",
             f"{'block':>10} {'depth':>6} {'threads':>8} {'write GB/s':>11} {'read GB/s':>10}"]
    b = result["best"]
    for p in result["points"]:
        mark = "  <- best" if all(p[k] == b[k] for k in ("block_size", "queue_depth", "io_threads")) else ""
        lines.append(f"{format_bytes(p['block_size']):>10} {p['queue_depth']:>6} {p['io_threads']:>8} "
                     f"{p['write_gbps']:>11.2f} {p['read_gbps']:>10.2f}{mark}")
    lines.append(f"best: block_size {format_bytes(b['block_size'])}, queue_depth {b['queue_depth']}, "
                 f"io_threads {b['io_threads']}: read {b['read_gbps']:.2f} GB/s, write "
                 f"{b['write_gbps']:.2f} GB/s")
    if result.get("cache_file"):
        lines.append(saved_line(result))
    for n in result["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)
