#!/usr/bin/env python3
"""Peak memory of consolidate, import and inspect against the number of tensors (JSON).

A mixture-of-experts checkpoint holds 50,000-100,000 small per-expert tensors: the offline
commands must stay flat in the tensor count, not only in bytes. This tool writes DeepSpeed
ZeRO-3 checkpoints of ``--tensors`` (default 100,000) and ``--baseline-tensors`` (default
1,000) tensors of ``--elems`` elements each with tools/make_deepspeed_checkpoint.py (AdamW
moments included, ``--world-size`` ranks, each ``--dtype``), then runs, each as its own
process, as a user types them:

    offload-engine consolidate DS OUT          (DeepSpeed in)
    offload-engine import deepspeed DS CK --world-size W
    offload-engine inspect DS
    offload-engine inspect CK                  (our format: what import wrote)
    offload-engine consolidate CK OUT2         (our format in)

Peak RSS is the whole process's, from the kernel: ``os.wait4``'s resource usage of that
child (``ru_maxrss``), not sampled. Wall time is printed too, but it is not a goal (the
disk and the load of the machine move it). Per command: the peak at both sizes, the
growth per added tensor (``bytes_per_tensor``: the slope between the two sizes), and
whether the peak at ``--tensors`` is under ``--goal`` (default 512 MiB). Medians of
``--runs`` runs.

    python tools/bench_many_tensors.py --path /work/bench/many --keep
    python tools/bench_many_tensors.py --dtype fp32 --dtype bf16 --tensors 100000

``--keep`` keeps the checkpoints in ``--path`` and reuses them on the next run (writing
100,000 tensors takes about 20 s). ``--smoke`` runs the same code at tiny sizes in
seconds (the test suite runs it so the tool cannot rot; its figures mean nothing).
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

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)
MiB = 1 << 20
HIDDEN = 16  # columns of each tensor: a tensor is (elems / HIDDEN) x HIDDEN
SMOKE = {"tensors": 300, "baseline_tensors": 30, "elems": 64, "runs": 1}


def log(msg: str) -> None:
    print(f"[bench_many_tensors] {msg}", file=sys.stderr, flush=True)


def make_checkpoint(path: str, tensors: int, elems: int, world: int, dtype: str,
                    keep: bool) -> dict:
    """A DeepSpeed ZeRO-3 checkpoint of ``tensors`` tensors at ``path`` (reused when
    ``keep`` and its summary is there)."""
    summary_path = os.path.join(path, "make_summary.json")
    if keep and os.path.exists(summary_path):
        with open(summary_path) as f:
            return json.load(f)
    shutil.rmtree(path, ignore_errors=True)
    cmd = [sys.executable, os.path.join(TOOLS, "make_deepspeed_checkpoint.py"), "--out", path,
           "--tensors", str(tensors), "--params", str(tensors * elems), "--hidden", str(HIDDEN),
           "--world", str(world), "--dtype", dtype]
    log(" ".join(cmd[1:]))
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    summary = json.loads(proc.stdout)
    with open(summary_path, "w") as f:
        json.dump(summary, f)
    return summary


def measured(cmd: list[str], timeout: float) -> dict:
    """Run ``cmd``; its exit code, wall time and peak RSS (bytes, from ``os.wait4``)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = start + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            pid, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.02)
    wall = time.monotonic() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace")[-2000:] if proc.stderr else ""
    return {"exit": proc.returncode, "wall_s": round(wall, 3),
            "peak_rss_bytes": usage.ru_maxrss * 1024, **({"stderr": err} if proc.returncode else {})}


def commands(ds: str, work: str, world: int) -> dict[str, list[str]]:
    """The five commands, in the order they run (import writes what the last two read)."""
    oe = [sys.executable, "-m", "offload_engine.cli.main"]
    ours = os.path.join(work, "imported")
    return {"consolidate_deepspeed": oe + ["consolidate", ds, os.path.join(work, "out_ds")],
            "import_deepspeed": oe + ["import", "deepspeed", ds, ours, "--world-size", str(world)],
            "inspect_deepspeed": oe + ["inspect", ds],
            "inspect_ours": oe + ["inspect", ours],
            "consolidate_ours": oe + ["consolidate", ours, os.path.join(work, "out_ours")]}


def run_size(ds: str, work: str, world: int, runs: int, timeout: float) -> dict:
    """Every command ``runs`` times on checkpoint ``ds``: medians and each run."""
    out: dict[str, dict] = {}
    for i in range(runs):
        for what in ("out_ds", "out_ours", "imported"):
            shutil.rmtree(os.path.join(work, what), ignore_errors=True)
        for name, cmd in commands(ds, work, world).items():
            r = measured(cmd, timeout)
            log(f"{name}: {r['peak_rss_bytes'] / MiB:.0f} MiB, {r['wall_s']} s"
                + (f", exit {r['exit']}" if r["exit"] else ""))
            out.setdefault(name, {"runs": []})["runs"].append(r)
    for name, entry in out.items():
        ok = [r for r in entry["runs"] if r["exit"] == 0]
        entry["failed_runs"] = len(entry["runs"]) - len(ok)
        entry["peak_rss_bytes_median"] = int(statistics.median(r["peak_rss_bytes"] for r in ok)) if ok else None
        entry["wall_s_median"] = round(statistics.median(r["wall_s"] for r in ok), 3) if ok else None
    for what in ("out_ds", "out_ours", "imported"):
        shutil.rmtree(os.path.join(work, what), ignore_errors=True)
    return out


def compare(large: dict, small: dict, n_large: int, n_small: int, goal: int) -> dict:
    """Per command: peaks at both sizes, bytes per added tensor, the goal met or not."""
    out = {}
    for name, big in large.items():
        a, b = small[name]["peak_rss_bytes_median"], big["peak_rss_bytes_median"]
        slope = (b - a) / (n_large - n_small) if None not in (a, b) and n_large > n_small else None
        out[name] = {"peak_rss_bytes": b, "baseline_peak_rss_bytes": a,
                     "bytes_per_tensor": round(slope, 1) if slope is not None else None,
                     "wall_s": big["wall_s_median"], "baseline_wall_s": small[name]["wall_s_median"],
                     "goal_met": b is not None and b <= goal}
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=100_000, help="tensors of the large checkpoint")
    p.add_argument("--baseline-tensors", type=int, default=1_000,
                   help="tensors of the small one (the per-tensor slope is taken between the two)")
    p.add_argument("--elems", type=int, default=256,
                   help=f"elements per tensor (a multiple of {HIDDEN}; default 256)")
    p.add_argument("--world-size", type=int, default=2, help="ranks of the DeepSpeed run and of the import")
    p.add_argument("--dtype", action="append", choices=("fp32", "bf16"),
                   help="model dtype of the DeepSpeed run (repeatable; default fp32)")
    p.add_argument("--runs", type=int, default=1, help="runs of each command (medians)")
    p.add_argument("--goal", type=float, default=512, help="peak RSS goal, MiB (default 512)")
    p.add_argument("--path", default=None, help="work folder (default: a temporary folder)")
    p.add_argument("--keep", action="store_true",
                   help="keep the checkpoints in --path and reuse them when there")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per command")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for the test suite")
    args = p.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    args.dtype = args.dtype or ["fp32"]
    if args.elems < HIDDEN or args.elems % HIDDEN:
        p.error(f"--elems must be a positive multiple of {HIDDEN}, got {args.elems}")
    if args.keep and not args.path:
        p.error("--keep needs --path (where the checkpoints stay)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    base = args.path or tempfile.mkdtemp(prefix="bench_many_tensors.")
    os.makedirs(base, exist_ok=True)
    goal = int(args.goal * MiB)
    result = {"environment": {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "kernel": platform.release(), "cpus": os.cpu_count(),
                              "python": platform.python_version(),
                              "loadavg_before": os.getloadavg()},
              "peak_rss_source": "os.wait4 ru_maxrss of each command's process (the kernel's "
                                 "high-water mark of its resident set, not sampled)",
              "settings": {"tensors": args.tensors, "baseline_tensors": args.baseline_tensors,
                           "elems": args.elems, "world_size": args.world_size,
                           "runs": args.runs, "goal_bytes": goal},
              "by_dtype": {}}
    try:
        for dtype in args.dtype:
            sizes = {}
            for n in (args.baseline_tensors, args.tensors):
                ds = os.path.join(base, f"ds_{dtype}_w{args.world_size}_{n}x{args.elems}")
                facts = make_checkpoint(ds, n, args.elems, args.world_size, dtype, args.keep)
                work = tempfile.mkdtemp(prefix="run.", dir=base)
                try:
                    log(f"{dtype}, {n} tensors")
                    sizes[n] = {"checkpoint": {k: facts.get(k) for k in
                                               ("tensors", "params", "bytes_written", "world_size",
                                                "model_dtype")},
                                "commands": run_size(ds, work, args.world_size, args.runs, args.timeout)}
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                    if not args.keep:
                        shutil.rmtree(ds, ignore_errors=True)
            table = compare(sizes[args.tensors]["commands"], sizes[args.baseline_tensors]["commands"],
                            args.tensors, args.baseline_tensors, goal)
            result["by_dtype"][dtype] = {"summary": table, "sizes": {str(k): v for k, v in sizes.items()},
                                         "goal_met": all(v["goal_met"] for v in table.values())}
        result["goal_met"] = all(v["goal_met"] for v in result["by_dtype"].values())
        result["environment"]["loadavg_after"] = os.getloadavg()
    finally:
        if not args.path:
            shutil.rmtree(base, ignore_errors=True)
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
