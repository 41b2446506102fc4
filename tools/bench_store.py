#!/usr/bin/env python3
"""Optimizer-like replay through the TieredStore, against the disk's own speed (JSON).

For N buckets of one state array larger than the pinned budget, every step acquires bucket
i, "computes" for a set time (a sleep: the GPU or another core would be busy, the host
thread is not), and releases it dirty. Two settings:

- compute-bound: compute per bucket = 2x the time the disk needs to read+write one bucket;
- I/O-bound:     compute per bucket = 0.25x that time.

The bound per step is max(total I/O time, total compute time), where the I/O time is the
bytes the step must move (one read and one write of each bucket not resident) at the
bandwidth fio measures in the same run for the same mix (50/50 read/write, O_DIRECT, the
store's block size, queue depth and streams: one fio job per stream, each on its own part of
the file at queue depth / streams). Goal: wall time <= 1.10x the bound in both settings.

Without --block-size and --queue-depth the store uses its defaults: the device profile's
choice per direction (docs/store.md, I/O settings), reported under "io"; fio then runs at
the profile's read block size, queue depth and streams. Each setting's store directory is removed
before the next one starts, so the disk needs room for one state, not two.

    python tools/bench_store.py --path /nvme/bench --state 2GiB --cpu-budget 512MiB

``--smoke`` runs the same code at tiny sizes (a 4 MiB state in 256 KiB buckets, a 1 MiB
pool, one measured step, an 8 MiB fio file) in seconds and prints the same JSON: the test
suite runs it so the tool cannot rot. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from offload_engine.cli.bench_io_methods import fio_job_args
from offload_engine.store import TieredStore
from offload_engine.units import parse_bytes


def fio_mixed_gbps(directory: str, size: int, block: int, qd: int, runs: int,
                   streams: int = 1) -> dict:
    """Median read+write GB/s of a 50/50 sequential O_DIRECT mix, plus pure read and write;
    ``streams`` jobs, each on its own 1/streams of the file (sizes in bytes)."""
    if shutil.which("fio") is None:
        raise SystemExit("bench_store: fio is not installed (apt-get install fio)")
    path = os.path.join(directory, "fio.dat")
    jobs = fio_job_args(size, block, qd, streams)
    out = {}
    for name, rw in (("mixed", ["--rw=rw", "--rwmixread=50"]), ("read", ["--rw=read"]),
                     ("write", ["--rw=write"])):
        vals = []
        for _ in range(runs):
            cmd = ["fio", "--name=bench", f"--filename={path}", *jobs, f"--bs={block}",
                   "--direct=1", "--ioengine=libaio", "--output-format=json",
                   *rw]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            job = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]
            moved = job["read"]["io_bytes"] + job["write"]["io_bytes"]
            # per direction, the group's longest job ("job_runtime" sums the jobs)
            seconds = max(job["read"]["runtime"], job["write"]["runtime"]) / 1e3
            vals.append(moved / seconds / 1e9)
        out[name] = {"gbps": statistics.median(vals), "runs": vals}
    os.unlink(path)
    out["args"] = " ".join(["fio --direct=1 --ioengine=libaio", f"--bs={block}", *jobs])
    return out


def replay(store: TieredStore, name: str, steps: int, compute_s: float) -> list[dict]:
    """Run ``steps`` optimizer-like steps; per step: wall seconds and the store's counters."""
    nb = len(store.bucket_ranges(name))
    rows = []
    for _ in range(steps):
        t0 = time.perf_counter()
        order = store.begin_step() or [(name, i) for i in range(nb)]
        for key in order:
            h = store.acquire(*key)
            h.tensor[:1].add_(1)  # touch it: the bytes must really be there
            time.sleep(compute_s)
            store.release(h, dirty=True)
        wall = time.perf_counter() - t0
        s = store.stats(reset=True)
        rows.append({"wall_s": wall, "read_bytes": s.bytes_read["nvme"],
                     "written_bytes": s.bytes_written["nvme"], "hits": s.hits, "misses": s.misses,
                     "io_wait_s": s.io_wait_s, "resident_buckets": len(store.resident_buckets())})
    return rows


def run_setting(args, directory: str, factor: float, disk_gbps: float) -> dict:
    bucket = args.bucket
    per_bucket_io_s = 2 * bucket / (disk_gbps * 1e9)  # one read + one write at the mixed rate
    compute_s = factor * per_bucket_io_s
    cfg = dict(nvme_paths=[directory], cpu_budget=args.cpu_budget, bucket_bytes=bucket,
               prefetch_depth=args.prefetch_depth, acquire_timeout_s=600)
    if args.queue_depth is not None:
        cfg.update(io_threads=args.queue_depth, queue_depth=args.queue_depth)
    if args.block_size is not None:
        cfg["block_size"] = args.block_size
    with TieredStore(cfg) as store:
        io = store.io_settings()
        numel = args.state // 4
        store.register("state", torch.float32, numel)
        nb = len(store.bucket_ranges("state"))
        replay(store, "state", 1, 0.0)  # step 0: records the order, first writes
        store.flush()
        store.stats(reset=True)
        rows = replay(store, "state", args.steps, compute_s)
        io["changes"] = store.io_settings()["changes"]
    shutil.rmtree(directory, ignore_errors=True)
    measured = []
    for r in rows:
        io_s = (r["read_bytes"] + r["written_bytes"]) / (disk_gbps * 1e9)
        compute_total = nb * compute_s
        bound = max(io_s, compute_total)
        measured.append({**r, "io_time_at_fio_s": io_s, "compute_s": compute_total,
                         "bound_s": bound, "wall_over_bound": r["wall_s"] / bound})
    capacity = args.cpu_budget // bucket
    return {
        "compute_per_bucket_s": compute_s, "buckets": nb, "pool_buckets": capacity, "io": io,
        "steps": measured,
        "median_wall_over_bound": statistics.median(m["wall_over_bound"] for m in measured),
        "median_wall_s": statistics.median(m["wall_s"] for m in measured),
        "bytes_per_step": {
            "read_buckets": [m["read_bytes"] // bucket for m in measured],
            "written_buckets": [m["written_bytes"] // bucket for m in measured],
            "expected_each": nb - capacity,
            "exactly_one_read_and_write_of_each_non_resident":
                all(m["read_bytes"] == m["written_bytes"] == (nb - capacity) * bucket
                    for m in measured),
        },
    }


# --smoke: the sizes it sets (everything else as given)
SMOKE = {"state": 4 << 20, "cpu_budget": 1 << 20, "bucket": 256 << 10, "steps": 1,
         "fio_runs": 1, "fio_size": 8 << 20, "prefetch_depth": 2}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", default=".", help="directory on the disk under test")
    p.add_argument("--state", type=parse_bytes, default=parse_bytes("2GiB"), help="state bytes")
    p.add_argument("--cpu-budget", type=parse_bytes, default=parse_bytes("512MiB"))
    p.add_argument("--bucket", type=parse_bytes, default=parse_bytes("64MiB"))
    p.add_argument("--block-size", type=parse_bytes, default=None,
                   help="store and fio block size (default: the device profile's)")
    p.add_argument("--queue-depth", type=int, default=None,
                   help="store and fio queue depth (default: the device profile's)")
    p.add_argument("--prefetch-depth", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--fio-runs", type=int, default=3)
    p.add_argument("--fio-size", type=parse_bytes, default=parse_bytes("1GiB"),
                   help="fio's file (at most --state)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, seconds, the same code and JSON (figures mean nothing)")
    args = p.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    if args.state <= args.cpu_budget:
        p.error("--state must be larger than --cpu-budget (the point is to offload)")
    work = tempfile.mkdtemp(prefix="bench-store-", dir=args.path)
    try:
        from offload_engine.io import device_profile

        profile = device_profile.choose(args.path)
        block = args.block_size or profile["read"]["block_bytes"]
        qd = args.queue_depth or profile["read"]["queue_depth"]
        streams = profile["read"].get("streams", 1)
        # fio refuses a file smaller than one block per job
        fio_size = max(min(args.state, args.fio_size), block * streams)
        fio = fio_mixed_gbps(work, fio_size, block, qd, args.fio_runs, streams)
        disk = fio["mixed"]["gbps"]
        result = {
            "state_bytes": args.state, "cpu_budget": args.cpu_budget, "bucket_bytes": args.bucket,
            "block_size": block, "queue_depth": qd, "streams": streams,
            "profile": {k: profile.get(k) for k in ("source", "read", "write", "probe_s")},
            "prefetch_depth": args.prefetch_depth, "steps": args.steps, "fio": fio,
            "compute_bound": run_setting(args, os.path.join(work, "a"), 2.0, disk),
            "io_bound": run_setting(args, os.path.join(work, "b"), 0.25, disk),
        }
        result["goal_wall_over_bound"] = 1.10
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
