#!/usr/bin/env python3
"""``offload-engine consolidate`` against DeepSpeed's ``zero_to_fp32.py`` (JSON).

Input: a real DeepSpeed ZeRO-3 checkpoint (fp32, world size 2) of a ~270M-parameter model,
made by DeepSpeed on CPU with ``tools/make_ds_checkpoint.py`` (``--make``, or pass
``--checkpoint``). Both tools turn it into ``model.safetensors`` (fp32):

- ``ours``: ``offload-engine consolidate CKPT OUT`` (default 5GB shards, fp32);
- ``deepspeed``: ``python CKPT/zero_to_fp32.py CKPT OUT --safe_serialization``, the script
  DeepSpeed copies into every checkpoint, run with ``--deepspeed-python`` (a venv with
  deepspeed 0.19.8 and huggingface_hub), ``DS_ACCELERATOR=cpu``.

Each run of each tool is a fresh process under ``/usr/bin/time -v`` (wall time, peak RSS,
file-system blocks in and out); before it, the outputs of earlier runs are synced, evicted
and deleted, and the checkpoint files are evicted from the page cache (fdatasync +
POSIX_FADV_DONTNEED, then mincore checks that nothing is resident), so both read from the
disk. The two tools alternate which goes first. Medians of ``--runs`` runs; ratios of medians.

In the same run fio measures the disk (sequential O_DIRECT read and write, 8 MiB blocks,
queue depth 8, a 2 GiB file in the checkpoint's file system), and our throughput is the
bytes we must move (the checkpoint bytes the output needs, plus the output written) over
our wall time. Finally our output is compared with DeepSpeed's, every tensor bit for bit.

Goal (issue 5): ours >= 3x faster (``speedup`` = deepspeed wall / ours) and <= 1/4 of
DeepSpeed's peak RSS (``rss_ratio`` = ours / deepspeed).

    python tools/bench_consolidate.py --path /work/bench --make \\
        --deepspeed-python /tmp/dsvenv/bin/python

``--deepspeed-python ''`` runs ours alone (no speedup, nothing compared). ``--smoke`` runs
the same code at tiny sizes in seconds and prints the same JSON (its figures mean nothing;
the test suite runs it so the tool cannot rot): one run of each tool, an 8 MiB fio file, and
a tiny checkpoint: with ``--make``, made by make_ds_checkpoint.py ``--smoke``; otherwise
``--checkpoint`` or the test suite's DeepSpeed fixture
``tests/fixtures/deepspeed_import/zero3_w2_fp32_adamw``.
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
sys.path.insert(0, ROOT)
sys.path.insert(0, TOOLS)

GOALS = {"speedup_at_least": 3.0, "rss_ratio_at_most": 0.25}
# --smoke: the sizes it sets (everything else as given), and its checkpoint without --make
SMOKE = {"runs": 1, "fio_size": 8 << 20, "fio_runs": 1, "timeout": 300.0}
SMOKE_CHECKPOINT = os.path.join(ROOT, "tests", "fixtures", "deepspeed_import", "zero3_w2_fp32_adamw")
TIME = "/usr/bin/time"


def log(msg: str) -> None:
    print(f"bench_consolidate: {msg}", file=sys.stderr, flush=True)


# -- /usr/bin/time -v ---------------------------------------------------------------------------
def parse_time_v(text: str) -> dict:
    """Wall seconds, peak RSS bytes, CPU seconds and file-system blocks from GNU time -v."""
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.strip().rpartition(": ")
        if sep:
            fields[key] = value.strip()
    wall = fields.get("Elapsed (wall clock) time (h:mm:ss or m:ss)")
    if wall is None:
        raise ValueError(f"no wall clock time in /usr/bin/time output:\n{text}")
    seconds = 0.0
    for part in wall.split(":"):
        seconds = seconds * 60 + float(part)
    return {
        "wall_s": seconds,
        "peak_rss_bytes": int(fields["Maximum resident set size (kbytes)"]) * 1024,
        "user_s": float(fields["User time (seconds)"]),
        "sys_s": float(fields["System time (seconds)"]),
        # 512-byte units: what the process really read from / wrote to the block layer
        "fs_read_bytes": int(fields.get("File system inputs", 0)) * 512,
        "fs_write_bytes": int(fields.get("File system outputs", 0)) * 512,
        "exit_status": int(fields.get("Exit status", 0)),
    }


def timed(cmd: list[str], env: dict | None, scratch: str, timeout: float) -> dict:
    """Run ``cmd`` under ``/usr/bin/time -v``; the figures plus the command's exit code."""
    tfile = os.path.join(scratch, "time.txt")
    proc = subprocess.run([TIME, "-v", "-o", tfile, *cmd], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)
    with open(tfile) as f:
        out = parse_time_v(f.read())
    os.unlink(tfile)
    out["returncode"] = proc.returncode
    if proc.returncode:
        out["stderr_tail"] = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
    return out


# -- page cache ---------------------------------------------------------------------------------
def clear(previous: str, others: list[str], checkpoint_files: list[str]) -> int:
    """Delete the tool's previous output, evict the other outputs and the checkpoint from
    the page cache; returns the checkpoint bytes still cached (mincore; should be 0)."""
    from offload_engine.io.page_cache import evict, resident_bytes

    if os.path.exists(previous):
        evict([previous])
        shutil.rmtree(previous)
    for out in others:
        if os.path.exists(out):
            evict([out])
    os.sync()
    evict(checkpoint_files)
    return resident_bytes(checkpoint_files)


# -- fio ----------------------------------------------------------------------------------------
def measure_disk(directory: str, size: int, runs: int) -> dict:
    """fio in ``directory``: sequential O_DIRECT read and write, 8 MiB blocks, queue depth 8
    (bench_store's fio runner; its 50/50 mix is reported too)."""
    from bench_store import fio_mixed_gbps

    return fio_mixed_gbps(directory, size, 8 << 20, 8, runs)


# -- the checkpoint -----------------------------------------------------------------------------
def make_checkpoint(python: str, path: str, world: int, smoke: bool = False) -> None:
    cmd = [python, os.path.join(TOOLS, "make_ds_checkpoint.py"), "--out", path, "--world", str(world),
           *(["--smoke"] if smoke else [])]
    log(f"making the DeepSpeed checkpoint: {' '.join(cmd)}")
    proc = subprocess.run(cmd, env={**os.environ, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"bench_consolidate: make_ds_checkpoint failed:\n{proc.stderr[-3000:]}")


def _byte_compiled() -> bool:
    """Whether offload_engine's modules have up-to-date .pyc files for this interpreter."""
    import importlib.util
    pkg = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "offload_engine")
    for folder, _dirs, files in os.walk(pkg):
        for f in files:
            if f.endswith(".py"):
                src = os.path.join(folder, f)
                pyc = importlib.util.cache_from_source(src)
                if not os.path.exists(pyc) or os.stat(pyc).st_mtime < os.stat(src).st_mtime:
                    return False
    return True


def checkpoint_facts(path: str) -> dict:
    """Files, sizes, and the bytes our consolidate needs from them (from the metadata only)."""
    from offload_engine.dtypes import FLOAT32
    from offload_engine.formats.deepspeed import DeepSpeedSource
    from offload_engine.offline.consolidate import output_dtype, plan_output

    with DeepSpeedSource(path) as src:
        infos = src.tensors()
        needed = sum(i.numel * i.dtype.itemsize for i in infos)
        plans, _index, _ = plan_output(src, 5 * 10**9, FLOAT32)
        facts = {"describe": src.describe(), "tag_dir": src.tag_dir, "world_size": src.world_size,
                 "zero_stage": src.stage, "tensors": len(infos),
                 "params": sum(i.numel for i in infos if i.kind == "param"),
                 "aliases": src.aliases(), "needed_read_bytes": needed,
                 "output_bytes": sum(p.file_size for p in plans),
                 "output_dtypes": sorted({str(output_dtype(i, FLOAT32)) for i in infos})}
        files = sorted(os.path.join(src.tag_dir, f) for f in os.listdir(src.tag_dir))
    facts["files"] = {os.path.basename(f): os.path.getsize(f) for f in files}
    facts["checkpoint_bytes"] = sum(facts["files"].values())
    info = os.path.join(path, "model_info.json")
    if os.path.exists(info):
        with open(info) as f:
            facts["made_by"] = json.load(f)
    return facts


# -- output comparison --------------------------------------------------------------------------
def _load_dir(out: str):
    """``{name: (file, alias_of_or_None)}`` and the per-file metadata of a safetensors folder."""
    from safetensors import safe_open

    index = os.path.join(out, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    where, aliases = {}, {}
    for fname in files:
        with safe_open(os.path.join(out, fname), framework="pt") as f:
            meta = f.metadata() or {}
            for k in f.keys():
                where[k] = fname
            aliases.update({k: v for k, v in meta.items() if k != "format"})
    return files, where, aliases


def compare_outputs(ours: str, theirs: str) -> dict:
    """Every tensor of DeepSpeed's output, bit for bit, against ours (a name we wrote once as
    a tied alias is compared through its owner)."""
    import torch
    from safetensors import safe_open

    _, our_where, our_aliases = _load_dir(ours)
    _, their_where, _ = _load_dir(theirs)
    problems, compared, through_alias, nbytes = [], 0, 0, 0
    handles: dict[str, object] = {}

    def tensor(out, where, name):
        key = (out, where[name])
        if key not in handles:
            handles[key] = safe_open(os.path.join(out, where[name]), framework="pt")
        return handles[key].get_tensor(name)

    for name in sorted(their_where):
        src = name
        if name not in our_where:
            src = our_aliases.get(name)
            if src is None or src not in our_where:
                problems.append(f"{name}: missing from ours")
                continue
            through_alias += 1
        a, b = tensor(ours, our_where, src), tensor(theirs, their_where, name)
        if a.dtype != b.dtype or a.shape != b.shape:
            problems.append(f"{name}: ours {a.dtype} {list(a.shape)}, deepspeed {b.dtype} {list(b.shape)}")
        elif not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            problems.append(f"{name}: bytes differ")
        compared += 1
        nbytes += b.numel() * b.element_size()
        del a, b
    extra = sorted(set(our_where) - set(their_where))
    problems += [f"{n}: only in ours" for n in extra]
    return {"equal": not problems, "tensors_compared": compared, "bytes_compared": nbytes,
            "compared_through_alias": through_alias, "problems": problems[:20]}


# -- the driver -------------------------------------------------------------------------------------
def median(xs):
    return statistics.median(xs) if xs else None


def summarize(runs: list[dict]) -> dict:
    ok = [r for r in runs if r["returncode"] == 0]
    out = {"runs": runs, "failed_runs": len(runs) - len(ok)}
    for key in ("wall_s", "peak_rss_bytes", "user_s", "sys_s", "fs_read_bytes", "fs_write_bytes", "flush_after_s"):
        vals = [r[key] for r in ok if r.get(key) is not None]
        out[f"{key}_median"] = median(vals)
    out["wall_s_runs"] = [r["wall_s"] for r in ok]
    # until its output is on the disk: safetensors' save_file leaves its writes to the kernel
    durable = [r["wall_s"] + r["flush_after_s"] for r in ok if r.get("flush_after_s") is not None]
    out["wall_plus_flush_s_median"] = median(durable)
    out["peak_rss_bytes_runs"] = [r["peak_rss_bytes"] for r in ok]
    return out


def startup_s(cmd: list[str], env: dict | None, runs: int) -> float:
    """Median seconds of a command that only starts the interpreter and imports the tool."""
    vals = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, capture_output=True, env={**os.environ, **(env or {})}, check=True)
        vals.append(time.perf_counter() - t0)
    return statistics.median(vals)


def main(argv=None) -> int:
    from offload_engine.io.page_cache import sync_tree
    from offload_engine.units import parse_bytes

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", help="folder on the disk under test; outputs (and, with --make, the "
                                  "checkpoint) go there (default: a new temporary folder)")
    p.add_argument("--checkpoint", help="DeepSpeed checkpoint folder (default: PATH/ds270m)")
    p.add_argument("--make", action="store_true",
                   help="make the checkpoint with tools/make_ds_checkpoint.py when it is missing")
    p.add_argument("--world", type=int, default=2, help="world size of a checkpoint made here")
    p.add_argument("--deepspeed-python", default="/tmp/dsvenv/bin/python",
                   help="interpreter with deepspeed 0.19.8 + huggingface_hub (runs zero_to_fp32.py); "
                        "'' to run ours alone")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--fio-size", type=parse_bytes, default=parse_bytes("2GiB"))
    p.add_argument("--fio-runs", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per tool run")
    p.add_argument("--keep", action="store_true",
                   help="keep the outputs (and a checkpoint made in a temporary folder)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, seconds, the same code and JSON (figures mean nothing)")
    args = p.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
        if not args.make and not args.checkpoint:
            args.checkpoint = SMOKE_CHECKPOINT
    startup_runs = 1 if args.smoke else 3

    if not os.path.exists(TIME):
        raise SystemExit(f"bench_consolidate: {TIME} is missing (apt-get install time)")
    if args.make and not args.deepspeed_python:
        raise SystemExit("bench_consolidate: --make needs --deepspeed-python")
    if args.deepspeed_python and not os.path.exists(args.deepspeed_python):
        raise SystemExit(f"bench_consolidate: {args.deepspeed_python} not found: "
                         f"python3 -m venv /tmp/dsvenv && /tmp/dsvenv/bin/pip install torch==2.13.0 "
                         f"deepspeed==0.19.8 huggingface_hub")
    made_temp = args.path is None
    base = args.path or tempfile.mkdtemp(prefix="bench_consolidate.")
    os.makedirs(base, exist_ok=True)
    ckpt = os.path.abspath(args.checkpoint or os.path.join(base, "ds270m"))
    made = False
    if not os.path.exists(os.path.join(ckpt, "latest")):
        if not args.make:
            raise SystemExit(f"bench_consolidate: no DeepSpeed checkpoint at {ckpt} (pass --make)")
        make_checkpoint(args.deepspeed_python, ckpt, args.world, args.smoke)
        made = True
    work = tempfile.mkdtemp(prefix="outputs.", dir=base)
    out_ours, out_ds = os.path.join(work, "ours"), os.path.join(work, "deepspeed")
    oe = os.path.join(os.path.dirname(sys.executable), "offload-engine")
    z2f = os.path.join(ckpt, "zero_to_fp32.py")
    ds_script = [z2f] if os.path.exists(z2f) else ["-m", "deepspeed.utils.zero_to_fp32"]
    ds_env = {"DS_ACCELERATOR": "cpu"}
    methods = {"ours": ([oe, "consolidate", ckpt, out_ours], None, out_ours)}
    if args.deepspeed_python:
        methods["deepspeed"] = ([args.deepspeed_python, *ds_script, ckpt, out_ds,
                                 "--safe_serialization"], ds_env, out_ds)
    try:
        facts = checkpoint_facts(ckpt)
        ckpt_files = [os.path.join(facts["tag_dir"], f) for f in facts["files"]]
        result = {"goals": GOALS, "environment": {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "kernel": platform.release(),
            "cpus": os.cpu_count(), "loadavg_before": os.getloadavg(),
            "python": platform.python_version(), "checkpoint": ckpt, "outputs": work,
            "checkpoint_on_the_measured_file_system": os.stat(ckpt).st_dev == os.stat(work).st_dev,
            # without .pyc files (an editable install under PYTHONDONTWRITEBYTECODE) each run
            # re-parses the package: quickstart.sh byte-compiles it, as pip does DeepSpeed's
            "ours_byte_compiled": _byte_compiled()},
            "checkpoint": facts,
            "commands": {k: "".join(f"{a}={b} " for a, b in (env or {}).items()) + f"{TIME} -v {' '.join(cmd)}"
                         for k, (cmd, env, _o) in methods.items()}}
        log(f"fio in {work} ({args.fio_size} bytes, {args.fio_runs} runs each)")
        result["fio"] = measure_disk(work, args.fio_size, args.fio_runs)
        log("startup (interpreter + imports, no work)")
        result["startup_s_median"] = {"ours": startup_s([oe, "consolidate", "--help"], None, startup_runs)}
        if "deepspeed" in methods:
            result["startup_s_median"]["deepspeed"] = startup_s(
                [args.deepspeed_python, "-c", "import deepspeed.utils.zero_to_fp32"], ds_env, startup_runs)
        runs: dict[str, list[dict]] = {k: [] for k in methods}
        for i in range(args.runs):
            order = list(methods) if i % 2 == 0 else list(methods)[::-1]
            for name in order:
                cmd, env, out = methods[name]
                resident = clear(out, [o for _c, _e, o in methods.values() if o != out], ckpt_files)
                log(f"run {i + 1}/{args.runs}: {name}")
                r = timed(cmd, env, base, args.timeout)
                r["run"] = i + 1
                r["checkpoint_cached_before_bytes"] = resident
                # writeback the tool left to the kernel (ours fsyncs; safetensors' save_file
                # does not), not part of its wall time: reported, not added
                t0 = time.perf_counter()
                if os.path.exists(out):
                    sync_tree(out)
                r["flush_after_s"] = time.perf_counter() - t0
                runs[name].append(r)
                log(f"  wall {r['wall_s']:.2f} s, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB, "
                    f"exit {r['returncode']}")
        result["methods"] = {k: summarize(v) for k, v in runs.items()}
        # without DeepSpeed: its figures and every ratio are None
        none = {"wall_s_median": None, "peak_rss_bytes_median": None, "wall_plus_flush_s_median": None,
                "failed_runs": None}
        ours, ds = result["methods"]["ours"], result["methods"].get("deepspeed", none)
        ok = ours["wall_s_median"] and ds["wall_s_median"]
        result["speedup"] = ds["wall_s_median"] / ours["wall_s_median"] if ok else None
        result["rss_ratio"] = ours["peak_rss_bytes_median"] / ds["peak_rss_bytes_median"] if ok else None
        # the same with each tool's output on the disk at the end (the goal is on wall time)
        result["speedup_output_on_disk"] = (ds["wall_plus_flush_s_median"] / ours["wall_plus_flush_s_median"]
                                            if ok and ours["wall_plus_flush_s_median"] else None)
        # derived, for the analysis: wall time less the start-up of an interpreter that only
        # imports the tool (torch included) and exits; both tools pay one
        work_s = {k: (result["methods"][k]["wall_s_median"] - result["startup_s_median"][k]
                      if result["methods"][k]["wall_s_median"] else None) for k in methods}
        result["after_startup"] = {"work_s": work_s, "speedup": work_s["deepspeed"] / work_s["ours"]
                                   if ok and work_s["ours"] > 0 else None}
        result["goals_met"] = {
            "speedup": bool(ok and result["speedup"] >= GOALS["speedup_at_least"]),
            "rss_ratio": bool(ok and result["rss_ratio"] <= GOALS["rss_ratio_at_most"])
        } if "deepspeed" in methods else {"speedup": None, "rss_ratio": None}
        moved = facts["needed_read_bytes"] + facts["output_bytes"]
        fio_r, fio_w = result["fio"]["read"]["gbps"], result["fio"]["write"]["gbps"]
        disk_bound_serial = facts["needed_read_bytes"] / fio_r / 1e9 + facts["output_bytes"] / fio_w / 1e9
        disk_bound_overlap = max(facts["needed_read_bytes"] / fio_r, facts["output_bytes"] / fio_w) / 1e9
        result["throughput"] = {
            "bytes_moved": moved,
            "ours_gbps": moved / ours["wall_s_median"] / 1e9 if ours["wall_s_median"] else None,
            # derived: the median wall time less the median start-up (interpreter, imports, exit)
            "ours_gbps_after_startup": (moved / (ours["wall_s_median"] - result["startup_s_median"]["ours"])
                                        / 1e9 if ours["wall_s_median"] else None),
            "deepspeed_gbps": moved / ds["wall_s_median"] / 1e9 if ds["wall_s_median"] else None,
            "fio_read_gbps": fio_r, "fio_write_gbps": fio_w,
            "disk_bound_s": {"read_then_write": disk_bound_serial, "overlapped": disk_bound_overlap},
            "ours_wall_over_disk_bound": (ours["wall_s_median"] / disk_bound_serial
                                          if ours["wall_s_median"] else None)}
        if "deepspeed" not in methods:
            result["outputs_equal"] = {"equal": None, "why": "DeepSpeed not run; nothing to compare"}
        elif all(os.path.exists(o) for _c, _e, o in methods.values()) and not ds["failed_runs"]:
            log("comparing the outputs tensor by tensor")
            result["outputs_equal"] = compare_outputs(out_ours, out_ds)
        else:
            result["outputs_equal"] = {"equal": None, "why": "a tool failed; nothing to compare"}
        print(json.dumps(result, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            if made and made_temp:
                shutil.rmtree(ckpt, ignore_errors=True)
            if made_temp:
                shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
