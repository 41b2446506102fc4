#!/usr/bin/env python3
"""``offload-engine import deepspeed`` of a 270M-parameter DeepSpeed checkpoint (JSON).

Input: the real DeepSpeed ZeRO-3 checkpoint (fp32, world size 2, AdamW) that
``tools/make_ds_checkpoint.py`` makes (default ``/work/bench/ds270m``; read, never written).
Each run imports it at ``--world-size`` (default 2) into a fresh folder on the disk under
test (``--path``, default: a temporary folder next to the checkpoint, so both are on the
same disk), as a fresh process under ``/usr/bin/time -v`` (wall time, peak RSS, bytes in
and out). Before each run the previous output is evicted and deleted and the checkpoint's
files are evicted from the page cache (bench_consolidate's ``clear``), so the import reads
from the disk. Medians of ``--runs`` runs.

In the same run fio measures the disk (bench_consolidate's ``measure_disk``: sequential
O_DIRECT read, write and a 50/50 mix, 8 MiB blocks, queue depth 8), and the import's
throughput (the bytes it must read plus the bytes it writes, over its wall time) is set
against the disk-bound time: reading at fio's read speed, then writing at its write speed.

    python tools/bench_import.py                     # /work/bench/ds270m, W=2 -> W=2

``--smoke`` runs the same code at tiny sizes in seconds and prints the same JSON (its
figures mean nothing; the test suite runs it so the tool cannot rot): one run, an 8 MiB fio
file, and by default the test suite's DeepSpeed fixture
``tests/fixtures/deepspeed_import/zero3_w2_fp32_adamw``, outputs under the system's
temporary folder (never beside the fixture).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)
sys.path.insert(0, ROOT)
sys.path.insert(0, TOOLS)

from bench_consolidate import SMOKE_CHECKPOINT, TIME, clear, measure_disk, summarize, timed  # noqa: E402

# --smoke: the sizes it sets (everything else as given)
SMOKE = {"runs": 1, "fio_size": 8 << 20, "fio_runs": 1, "timeout": 300.0}


def log(msg: str) -> None:
    print(f"bench_import: {msg}", file=sys.stderr, flush=True)


def checkpoint_facts(path: str) -> dict:
    """Files, parameters, and the bytes the import reads (every state it carries over)."""
    from offload_engine.formats.deepspeed import DeepSpeedSource

    with DeepSpeedSource(path) as src:
        tensors = src.tensors()
        facts = {"describe": src.describe(), "tag_dir": src.tag_dir, "world_size": src.world_size,
                 "zero_stage": src.stage, "tensors": len(tensors),
                 "params": sum(t.numel for t in tensors if t.kind == "param"),
                 "read_bytes": sum(s.numel * s.dtype.itemsize for t in tensors
                                   for s in t.states.values())}
        files = sorted(os.path.join(src.tag_dir, f) for f in os.listdir(src.tag_dir))
    facts["files"] = {os.path.basename(f): os.path.getsize(f) for f in files}
    facts["checkpoint_bytes"] = sum(facts["files"].values())
    return facts


def output_bytes(out: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(out):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def main(argv=None) -> int:
    from offload_engine.units import parse_bytes

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None,
                   help="DeepSpeed checkpoint folder (default /work/bench/ds270m; with --smoke, "
                        "the test suite's fixture)")
    p.add_argument("--path", help="folder on the disk under test for the outputs (default: a "
                                  "temporary folder beside the checkpoint)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--fio-size", type=parse_bytes, default=parse_bytes("2GiB"))
    p.add_argument("--fio-runs", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, seconds, the same code and JSON (figures mean nothing)")
    args = p.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    args.checkpoint = args.checkpoint or (SMOKE_CHECKPOINT if args.smoke else "/work/bench/ds270m")
    if not os.path.exists(TIME):
        raise SystemExit(f"bench_import: {TIME} is missing (apt-get install time)")
    ckpt = os.path.abspath(args.checkpoint)
    if not os.path.exists(os.path.join(ckpt, "latest")):
        raise SystemExit(f"bench_import: no DeepSpeed checkpoint at {ckpt} "
                         f"(make one: tools/make_ds_checkpoint.py --out {ckpt})")
    beside = None if args.smoke else os.path.dirname(ckpt)   # the fixture's folder stays clean
    if args.path:
        os.makedirs(args.path, exist_ok=True)  # as bench_consolidate: a new folder is made
    base = tempfile.mkdtemp(prefix="bench_import.", dir=args.path or beside)
    out = os.path.join(base, "out")
    oe = os.path.join(os.path.dirname(sys.executable), "offload-engine")
    cmd = [oe, "import", "deepspeed", ckpt, out, "--world-size", str(args.world_size)]
    env = {"PYTHONPATH": ROOT}
    try:
        facts = checkpoint_facts(ckpt)
        files = [os.path.join(facts["tag_dir"], f) for f in facts["files"]]
        result = {"environment": {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "kernel": platform.release(),
            "cpus": os.cpu_count(), "loadavg_before": os.getloadavg(),
            "python": platform.python_version(), "checkpoint": ckpt, "outputs": base,
            "same_file_system": os.stat(ckpt).st_dev == os.stat(base).st_dev},
            "checkpoint": facts, "command": f"PYTHONPATH={ROOT} {TIME} -v {' '.join(cmd)}"}
        log(f"fio in {base} ({args.fio_size} bytes, {args.fio_runs} runs each)")
        result["fio"] = measure_disk(base, args.fio_size, args.fio_runs)
        runs, written = [], None
        for i in range(args.runs):
            resident = clear(out, [], files)
            log(f"run {i + 1}/{args.runs}")
            r = timed(cmd, env, base, args.timeout)
            r["run"] = i + 1
            r["checkpoint_cached_before_bytes"] = resident
            if r["returncode"] == 0:
                written = output_bytes(out)
            runs.append(r)
            log(f"  wall {r['wall_s']:.2f} s, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB, "
                f"exit {r['returncode']}")
        clear(out, [], files)
        result["import"] = summarize(runs)
        wall = result["import"]["wall_s_median"]
        fio_r, fio_w = result["fio"]["read"]["gbps"], result["fio"]["write"]["gbps"]
        read, write = facts["read_bytes"], written or 0
        serial = read / fio_r / 1e9 + write / fio_w / 1e9
        result["throughput"] = {
            "read_bytes": read, "written_bytes": write,
            "gbps": (read + write) / wall / 1e9 if wall else None,
            "fio_read_gbps": fio_r, "fio_write_gbps": fio_w,
            "fio_mixed_gbps": result["fio"]["mixed"]["gbps"],
            "disk_bound_s": {"read_then_write": serial,
                             "overlapped": max(read / fio_r, write / fio_w) / 1e9},
            "wall_over_disk_bound": wall / serial if wall else None}
        result["environment"]["loadavg_after"] = os.getloadavg()
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
