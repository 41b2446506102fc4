#!/usr/bin/env python3
"""offload-engine inspect at scale (JSON): listing cost, and --stats against the disk.

1. **Listing.** A live store of 50,000 tensors over 8 ranks in the documented manifest
   format (docs/format.md: the tensor table in the group's zarr.json, one shard table per
   rank in ``rank{r}/zarr.json``; MoE-like: attention and expert matrices on Muon, norms
   and routers on AdamW; arrays declared, chunk files absent: listing must not need them),
   written by the same manifest helpers as ``save_checkpoint`` and ZeroMuon
   (``tests/helpers/synthetic.py``, the test suite's writer). A fresh process opens it and builds the summary and
   the tensor table, as ``offload-engine inspect`` does before printing (imports excluded),
   with the page cache evicted first.
   Reported: seconds, bytes read (``/proc/self/io`` rchar, every read() of the process
   in that span), the sizes of the tensor table and of the shard tables, and how much of
   the time is ``json.loads`` of the tensor table. Goal: < 2 s and < 8 MB.
   Also, in another fresh process: the one-off cost of reading and checking every shard
   table, which ``--stats``, ``export`` and ``diff`` pay before their first read.
2. **--stats.** A store of ``--state`` bytes (default 1.5 GiB of fp32 state, 8 ranks,
   64 MiB chunk files) streamed by ``collect_stats`` in a fresh process after evicting
   the page cache; against fio reading a file of the same size in the same directory
   (``fio --direct=1 --ioengine=libaio --rw=read --bs=8M --iodepth=8``), runs
   interleaved, medians reported. Goal: >= 80% of fio's bandwidth, peak RSS <= 512 MB.

    python tools/bench_inspect.py --path /nvme/bench [--state 1.5GiB] [--runs 3]

``--smoke`` runs the same code at tiny sizes (200 tensors over 2 ranks; the smallest
``--stats`` store, 24 MiB; one run) in seconds and prints the same JSON: the test suite runs
it so the tool cannot rot. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# the test suite's manifest writer (tests/helpers/synthetic.py) builds the stores
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

GOALS = {"list_seconds": 2.0, "list_read_bytes": 8e6, "stats_vs_fio": 0.8,
         "stats_peak_rss_bytes": 512e6}
# --smoke: the sizes it sets (everything else as given); 1 MiB of state gives the smallest
# --stats store (one Muon and one AdamW matrix: 24 MiB)
SMOKE = {"tensors": 200, "world_size": 2, "state": "1MiB", "runs": 1}


def peak_rss() -> int:
    """VmHWM: this process's peak resident set. (ru_maxrss is not usable in a child: Linux
    carries the forking parent's high-water mark across exec.)"""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


# -- building the inputs ---------------------------------------------------------------------

def moe_tensors(count: int) -> dict:
    """``count`` tensor specs of an MoE-like model, no data (states given as dtypes)."""
    import torch
    f32 = torch.float32
    muon = {"momentum_buffer": f32}
    adamw = {"exp_avg": f32, "exp_avg_sq": f32}
    out = {"model.embed_tokens.weight": {"shape": [129280, 2048], "dtype": torch.bfloat16,
                                         "optimizer": "adamw", "states": adamw},
           "lm_head.weight": {"shape": [129280, 2048], "dtype": torch.bfloat16,
                              "optimizer": "adamw", "states": adamw}}
    layer = 0
    while len(out) < count:
        p = f"model.layers.{layer}"
        specs = [(f"{p}.input_layernorm.weight", [2048], "adamw"),
                 (f"{p}.post_attention_layernorm.weight", [2048], "adamw")]
        specs += [(f"{p}.self_attn.{m}.weight", [2048, 2048], "muon") for m in "qkvo"]
        specs.append((f"{p}.mlp.gate.weight", [256, 2048], "adamw"))
        for e in range(256):
            specs += [(f"{p}.mlp.experts.{e}.{w}.weight", [1408, 2048] if w != "down_proj"
                       else [2048, 1408], "muon") for w in ("gate_proj", "up_proj", "down_proj")]
        for name, shape, opt in specs:
            if len(out) >= count:
                break
            out[name] = {"shape": shape, "dtype": torch.bfloat16, "optimizer": opt,
                         "states": muon if opt == "muon" else adamw}
        layer += 1
    return out


def build_list_store(path: str, tensors: int, world: int) -> dict:
    from helpers.synthetic import write_sharded
    from offload_engine.layout.manifest import shard_table_path
    t0 = time.perf_counter()
    attrs = write_sharded(path, moe_tensors(tensors), world, kind="store", step=1000, data=False)
    tables = [os.path.getsize(shard_table_path(path, r)) for r in range(world)]
    return {"build_seconds": time.perf_counter() - t0, "arrays": len(attrs["arrays"]),
            "manifest_bytes": os.path.getsize(os.path.join(path, "zarr.json")),
            "shard_tables_bytes": sum(tables), "shard_table_bytes_max": max(tables)}


def build_stats_store(path: str, state_bytes: int, world: int) -> dict:
    """Muon matrices (momentum) and AdamW matrices (two moments), half the bytes each,
    filled with random fp32 values, 64 MiB chunk files."""
    import torch
    from helpers.synthetic import write_sharded
    from offload_engine.io import AsyncFileIO
    from offload_engine.layout import FlatArray
    f32 = torch.float32
    mat = 2048 * 1024 * 4                       # one 2048x1024 fp32 state: 8 MiB
    n_muon = max(1, state_bytes // 2 // mat)
    n_adam = max(1, state_bytes // 2 // (2 * mat))
    tensors = {}
    for i in range(n_muon):
        tensors[f"layers.{i}.mlp.w.weight"] = {"shape": [2048, 1024], "dtype": torch.bfloat16,
                                               "optimizer": "muon",
                                               "states": {"momentum_buffer": f32}}
    for i in range(n_adam):
        tensors[f"layers.{i}.embed_part.weight"] = {"shape": [2048, 1024], "dtype": torch.bfloat16,
                                                    "optimizer": "adamw",
                                                    "states": {"exp_avg": f32, "exp_avg_sq": f32}}
    t0 = time.perf_counter()
    manifest = write_sharded(path, tensors, world, kind="store", step=1000, data=False)
    g = torch.Generator().manual_seed(0)
    total = 0
    piece = 16 << 20
    with AsyncFileIO(threads=4, queue_depth=4) as io:
        for name, meta in manifest["arrays"].items():
            flat = FlatArray.open(os.path.join(path, name), io=io, mode="r+")
            for lo in range(0, flat.numel, piece):
                n = min(piece, flat.numel - lo)
                flat.write(lo, torch.randn(n, generator=g))
            flat.sync().result()
            total += flat.numel * 4
    return {"build_seconds": time.perf_counter() - t0, "tensors": len(tensors),
            "arrays": len(manifest["arrays"]), "state_bytes": total}


# -- children: one fresh process per measurement ------------------------------------------------

def child_list(path: str) -> dict:
    from offload_engine.cli.inspect import listing, open_input
    from offload_engine.io.page_cache import evict
    evict([path])
    r0, t0 = rchar(), time.perf_counter()
    with open_input(path) as source:
        _, summary, rows = listing(source)
    t1, r1 = time.perf_counter(), rchar()
    # the share of json parsing, on the same (now cached) tensor table, as the reader does it
    import gc
    with open(os.path.join(path, "zarr.json"), "rb") as f:
        raw = f.read()
    gc.disable()
    t2 = time.perf_counter()
    json.loads(raw)
    parse = time.perf_counter() - t2
    gc.enable()
    return {"seconds": t1 - t0, "read_bytes": r1 - r0, "tensors": len(rows),
            "world_size": summary["world_size"], "json_loads_seconds": parse,
            "peak_rss_bytes": peak_rss()}


def child_tables(path: str) -> dict:
    """What --stats, export and diff pay once before reading data: every shard table read,
    parsed and checked against the tensor table."""
    from offload_engine.formats import open_source
    from offload_engine.io.page_cache import evict
    evict([path])
    with open_source(path) as source:
        r0, t0 = rchar(), time.perf_counter()
        placements = source.placements()
        seconds, read = time.perf_counter() - t0, rchar() - r0
    return {"seconds": seconds, "read_bytes": read, "placements": len(placements),
            "peak_rss_bytes": peak_rss()}


def child_stats(path: str) -> dict:
    from offload_engine.formats import open_source
    from offload_engine.offline.inspect_stats import collect_stats
    from offload_engine.io.page_cache import evict, resident_bytes
    evict([path])
    cached = resident_bytes([path])
    r0, t0 = rchar(), time.perf_counter()
    with open_source(path) as source:
        keys = [(t.name, s) for t in source.tensors() for s in t.states]
        stats, nbytes = collect_stats(source, keys)
        direct = source._io.stats.direct_pieces, source._io.stats.buffered_pieces
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "bytes_read": nbytes, "gbps": nbytes / seconds / 1e9,
            "rchar": rchar() - r0, "keys": len(keys), "cached_before_bytes": cached,
            "direct_pieces": direct[0], "buffered_pieces": direct[1],
            "window_bytes": source.window_bytes, "depth": source.depth,
            "nonfinite": sum(1 for s in stats.values() if s["nan"] or s["inf"]),
            "peak_rss_bytes": peak_rss()}


def run_child(kind: str, path: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, f"--child-{kind}", path],
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"bench_inspect: {kind} child failed:\n{proc.stderr}")
    return json.loads(proc.stdout)


def fio_read(path: str, size: int) -> float:
    """GB/s of fio reading ``size`` bytes of ``path`` sequentially, O_DIRECT, 8 MiB x 8."""
    if shutil.which("fio") is None:
        raise SystemExit("bench_inspect: fio is not installed (apt-get install fio)")
    cmd = ["fio", "--name=read", f"--filename={path}", f"--size={size}", "--bs=8M",
           "--iodepth=8", "--direct=1", "--ioengine=libaio", "--rw=read",
           "--output-format=json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]
    return job["read"]["bw_bytes"] / 1e9


def main(argv=None) -> int:
    children = {"--child-list": child_list, "--child-tables": child_tables,
                "--child-stats": child_stats}
    if len(sys.argv) == 3 and sys.argv[1] in children:
        fn = children[sys.argv[1]]
        print(json.dumps(fn(sys.argv[2])))
        return 0
    from offload_engine.units import parse_bytes
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", help="directory on the disk to measure (default: a temporary "
                                   "folder under /tmp)")
    ap.add_argument("--tensors", type=int, default=50_000)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--state", default="1.5GiB", help="state bytes of the --stats store")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip", choices=["list", "stats"], action="append", default=[])
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes, seconds, the same code and JSON (figures mean nothing)")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    base = tempfile.mkdtemp(prefix="bench_inspect.", dir=args.path)
    out = {"goals": GOALS, "environment": {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "directory": base,
        "kernel": platform.release(), "cpus": os.cpu_count(),
        "loadavg_before": os.getloadavg(), "python": platform.python_version()}}
    try:
        if "list" not in args.skip:
            store = os.path.join(base, "list-store")
            built = build_list_store(store, args.tensors, args.world_size)
            runs = [run_child("list", store) for _ in range(args.runs)]
            tables = [run_child("tables", store) for _ in range(args.runs)]
            med = lambda k, rs=runs: statistics.median(r[k] for r in rs)
            out["list"] = {**built, "tensors": args.tensors, "world_size": args.world_size,
                           "seconds": med("seconds"), "read_bytes": med("read_bytes"),
                           "json_loads_seconds": med("json_loads_seconds"),
                           "peak_rss_bytes": med("peak_rss_bytes"), "runs": runs,
                           "meets_time_goal": med("seconds") < GOALS["list_seconds"],
                           "meets_bytes_goal": med("read_bytes") < GOALS["list_read_bytes"],
                           "shard_tables": {"seconds": med("seconds", tables),
                                            "read_bytes": med("read_bytes", tables),
                                            "peak_rss_bytes": med("peak_rss_bytes", tables),
                                            "runs": tables}}
            shutil.rmtree(store)
        if "stats" not in args.skip:
            store = os.path.join(base, "stats-store")
            built = build_stats_store(store, parse_bytes(args.state), args.world_size)
            fio_file = os.path.join(base, "fio.dat")
            size = built["state_bytes"]
            fio_read(fio_file, size)  # lays the file out (fio writes it first)
            fio_runs, stats_runs = [], []
            for _ in range(args.runs):
                fio_runs.append(fio_read(fio_file, size))
                stats_runs.append(run_child("stats", store))
            fio = statistics.median(fio_runs)
            gbps = statistics.median(r["gbps"] for r in stats_runs)
            rss = max(r["peak_rss_bytes"] for r in stats_runs)
            out["stats"] = {**built, "fio_read_gbps": fio, "fio_runs": fio_runs,
                            "stats_gbps": gbps, "ratio_vs_fio": gbps / fio,
                            "peak_rss_bytes": rss, "runs": stats_runs,
                            "fio_args": "fio --direct=1 --ioengine=libaio --rw=read --bs=8M "
                                        f"--iodepth=8 --size={size}",
                            "meets_bandwidth_goal": gbps / fio >= GOALS["stats_vs_fio"],
                            "meets_rss_goal": rss <= GOALS["stats_peak_rss_bytes"]}
    finally:
        out["environment"]["loadavg_after"] = os.getloadavg()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
