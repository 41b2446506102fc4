#!/usr/bin/env python3
"""Every benchmark of docs/benchmarks.md in one command: runs the tools in tools/ as
subprocesses at the sizes of a mode, writes one JSON with every figure and the headline table
(markdown) to ``--out``, and prints the JSON.

Modes:

- ``--quick``: small sizes, minutes on a laptop: I/O at 1 GiB, a 2 GiB store, the step on a
  ~20 M decoder, a 27 M DeepSpeed-format checkpoint, a 50 M model for the large-run tool;
- ``--full``: the sizes of issue 32: I/O at 8 GiB against fio, zarr-python and tensorstore;
  the store at a state 5% larger than this machine's RAM; the optimizer step at ~134 M and
  ~1 B parameters, W=2, fp32 and bf16 with masters, both rules (ZeroMuon Muon against
  DeepSpeed ZeRO-3 Muon with NVMe offload, ZeroMuon all-AdamW against DeepSpeed
  ZeRO-Infinity AdamW); checkpoint stall; consolidate and import of generated DeepSpeed
  checkpoints of 270 M and 2.7 B parameters against the fio bound and zero_to_fp32; inspect;
  plan start-up; a decoder of at least 3 B parameters whose optimizer state is 1.1x this
  machine's RAM or more (both rules, against DeepSpeed; the Muon rule's smaller state per
  parameter takes 3.4 B at 25 GB of RAM). Hours, and about 70 GB of free disk at ``--path`` (the 2.7 B
  checkpoint and its import at once);
- ``--tiny``: every tool's ``--smoke`` (seconds each; figures mean nothing): checks that the
  whole chain runs.

A peer that is missing is reported, not a crash: without fio the benchmarks that measure
the disk with it are ``skipped`` with why (``bench io`` falls back to its O_DIRECT loop);
without an interpreter that imports deepspeed (``--deepspeed-python``, default
``$OFFLOAD_ENGINE_DEEPSPEED_PYTHON``) ours runs alone and ``peers_skipped`` says so; without
tensorstore or zarr-python ``bench io`` reports that method as skipped. A benchmark whose
tool fails is ``failed`` with its exit code and the last lines of its output; the others
still run. Each entry records the command, the load average before and after, and its
wall time; the whole run records the machine (CPU model, cores, RAM, the disk under
``--path``), the date and the git commit.

    python tools/bench_all.py --quick --path /nvme/bench --out results/
    python tools/bench_all.py --full --path /nvme/bench --out results/ \\
        --deepspeed-python /work/dsvenv/bin/python
    python tools/bench_all.py --full --dry-run        # the commands it would run, nothing run

``--only io,startup`` runs a subset (names: ``--dry-run`` lists them). The report is written
to ``--out`` after every benchmark; ``--resume`` carries on the run there (same mode, same
machine and disk, else refused): what finished is kept, what --only names or what did not
finish runs, the rest is ``pending``. ``--full`` takes more hours than most people leave a
machine alone, so it can be run in sittings:

    python tools/bench_all.py --full --out results/full --only io,store,checkpoint
    python tools/bench_all.py --full --out results/full --resume   # everything not yet done

Each benchmark records its own date and commit. Exit code 1 when a benchmark failed, 0
otherwise (skipped and pending ones included).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)
sys.path.insert(0, TOOLS)

from bench_all_report import headline, load_previous, write_report  # noqa: E402
from bench_step import run_group  # noqa: E402  (kills the tool's whole session on timeout)

DEEPSPEED_PYTHON_ENV = "OFFLOAD_ENGINE_DEEPSPEED_PYTHON"
GiB = 1 << 30


@dataclasses.dataclass
class Bench:
    """One benchmark: the tool's command (``{work}`` is its scratch folder under --path,
    ``{ds}`` the DeepSpeed interpreter), commands to run before it (making its input) and
    after it (freeing the disk), what it cannot run without, what it runs without (peers)
    and free disk it needs (bytes)."""
    name: str
    title: str
    argv: list[str]
    before: list[list[str]] = dataclasses.field(default_factory=list)
    after: list[list[str]] = dataclasses.field(default_factory=list)
    needs: tuple[str, ...] = ()
    deepspeed: tuple[str, ...] = ()   # the flags that add DeepSpeed, "{ds}" in them
    no_deepspeed: tuple[str, ...] = ()   # the flags that leave it out, where it is missing
    peer: str = "deepspeed"   # what DeepSpeed must do here: "deepspeed" or "zero_to_fp32"
    disk_bytes: int = 0
    timeout_s: float = 3600
    input_dir: str = ""   # what "before" makes when it is not there ("{path}/..."), and its bytes
    input_bytes: int = 0


def tool(name: str, *args) -> list[str]:
    return [sys.executable, os.path.join(TOOLS, name), *map(str, args)]


# -- the plans ----------------------------------------------------------------------------------
def step_bench(label: str, dim: int, layers: int, rule: str, extra: list, timeout: float) -> Bench:
    rules = {"muon": "ZeroMuon Muon vs DeepSpeed ZeRO-3 Muon NVMe",
             "adamw": "ZeroMuon all-AdamW vs DeepSpeed ZeRO-Infinity AdamW"}
    return Bench(f"step_{label}_{rule}", f"optimizer step, {label}, W=2: {rules[rule]}",
                 tool("bench_step.py", "--path", "{work}", "--world", 2, "--dim", dim,
                      "--layers", layers, "--rule", rule, "--masters", "both", *extra),
                 needs=("fio",), deepspeed=("--deepspeed-python", "{ds}"), timeout_s=timeout)


def checkpoint_chain(label: str, params: float, make_extra: list, extra: list,
                     timeout: float) -> list[Bench]:
    """Make a DeepSpeed-format ZeRO-3 checkpoint (W=2, fp32), consolidate it (ours against
    zero_to_fp32), import it; the checkpoint is removed after the import."""
    ckpt = os.path.join("{path}", f"ds_{label}")
    make = tool("make_deepspeed_checkpoint.py", "--params", params, "--world", 2, *make_extra)
    # made once, by whichever of the two runs first (a folder without `latest` is a torn one)
    ensure = ["sh", "-c", f'test -e "$0/latest" || ( rm -rf "$0" && {shlex.join(make)} --out "$0" )',
              ckpt]
    # bytes: the checkpoint holds fp32 masters and two moments (12 B per parameter; 32.2 GB
    # at 2.7 B), and so does its import; consolidate writes the fp32 weights; fio's file
    size, fio = int(params * 12.5), int(2.2 * GiB)
    return [
        Bench(f"consolidate_{label}", f"consolidate {label} vs zero_to_fp32 and the fio bound",
              tool("bench_consolidate.py", "--path", "{work}", "--checkpoint", ckpt, *extra),
              before=[ensure], needs=("fio", "time"), deepspeed=("--deepspeed-python", "{ds}"),
              no_deepspeed=("--deepspeed-python", ""), peer="zero_to_fp32",
              disk_bytes=int(params * 4.1) + fio, input_dir=ckpt, input_bytes=size,
              timeout_s=timeout),
        Bench(f"import_{label}", f"import deepspeed {label} vs the fio bound",
              tool("bench_import.py", "--path", "{work}", "--checkpoint", ckpt, *extra),
              before=[ensure], after=[["rm", "-rf", ckpt]], needs=("fio", "time"),
              disk_bytes=size + fio, input_dir=ckpt, input_bytes=size, timeout_s=timeout)]


def plan_tiny() -> list[Bench]:
    return [
        Bench("io", "I/O: engine vs fio, zarr-python, tensorstore",
              tool("bench_io.py", "--path", "{work}", "--smoke"), timeout_s=300),
        Bench("store", "tiered store, state larger than the pool",
              tool("bench_store.py", "--path", "{work}", "--smoke"), needs=("fio",), timeout_s=300),
        Bench("step_muon", "optimizer step: ZeroMuon Muon vs DeepSpeed ZeRO-3 Muon NVMe",
              tool("bench_step.py", "--path", "{work}", "--smoke", "--rule", "muon"),
              needs=("fio",), deepspeed=("--deepspeed-python", "{ds}"), timeout_s=900),
        Bench("step_adamw", "optimizer step: ZeroMuon all-AdamW vs DeepSpeed ZeRO-Infinity AdamW",
              tool("bench_step.py", "--path", "{work}", "--smoke", "--rule", "adamw"),
              needs=("fio",), deepspeed=("--deepspeed-python", "{ds}"), timeout_s=900),
        Bench("checkpoint", "checkpoint stall", tool("bench_checkpoint.py", "--path", "{work}", "--smoke"),
              needs=("fio",), timeout_s=300),
        Bench("consolidate", "consolidate vs zero_to_fp32 and the fio bound",
              tool("bench_consolidate.py", "--path", "{work}", "--smoke"), needs=("fio", "time"),
              deepspeed=("--deepspeed-python", "{ds}"), no_deepspeed=("--deepspeed-python", ""),
              peer="zero_to_fp32", timeout_s=900),
        Bench("import", "import deepspeed vs the fio bound",
              tool("bench_import.py", "--path", "{work}", "--smoke"), needs=("fio", "time"),
              timeout_s=300),
        Bench("inspect", "inspect: listing and --stats",
              tool("bench_inspect.py", "--path", "{work}", "--smoke"),
              needs=("fio",), timeout_s=300),
        Bench("startup", "start-up: plan vs import torch", tool("bench_startup.py", "--smoke"),
              timeout_s=300),
        Bench("train_large", "training with the state on NVMe, against its bound and DeepSpeed",
              tool("bench_train_large.py", "--path", "{work}", "--smoke"),
              deepspeed=("--peer", "deepspeed", "--deepspeed-python", "{ds}"), timeout_s=900),
    ]


def plan_quick() -> list[Bench]:
    fio = ["--fio-size", "256MiB", "--fio-runs", 1]
    return [
        Bench("io", "I/O at 1 GiB: engine vs fio, zarr-python, tensorstore",
              tool("bench_io.py", "--path", "{work}", "--size", "1GiB", "--runs", 1),
              disk_bytes=6 * GiB, timeout_s=1800),
        Bench("store", "tiered store, 2 GiB state, 512 MiB pool",
              tool("bench_store.py", "--path", "{work}", "--state", "2GiB", "--cpu-budget", "512MiB",
                   "--bucket", "64MiB", "--steps", 2, *fio),
              needs=("fio",), disk_bytes=3 * GiB, timeout_s=1800),
        step_bench("20m", 256, 4, "muon", ["--steps", 2, "--warmup", 1, *fio], 1800),
        step_bench("20m", 256, 4, "adamw", ["--steps", 2, "--warmup", 1, *fio], 1800),
        Bench("checkpoint", "checkpoint stall, ~20 M model",
              tool("bench_checkpoint.py", "--path", "{work}", "--dim", 256, "--layers", 4,
                   "--runs", 2, *fio), needs=("fio",), timeout_s=1800),
        *checkpoint_chain("27m", 27e6, [], ["--runs", 2, *fio], 1800),
        Bench("inspect", "inspect: 5,000 tensors listed, 256 MiB --stats",
              tool("bench_inspect.py", "--path", "{work}", "--tensors", 5000, "--state", "256MiB",
                   "--runs", 1), needs=("fio",), timeout_s=1800),
        Bench("startup", "start-up: plan vs import torch", tool("bench_startup.py", "--runs", 3),
              timeout_s=600),
        Bench("train_large_adamw", "training, 50 M, all-AdamW, state on NVMe",
              tool("bench_train_large.py", "--path", "{work}", "--params", 5e7, "--rule", "adamw",
                   "--steps", 2, "--bucket-bytes", "4MiB", "--pool", "128MiB", *fio),
              deepspeed=("--peer", "deepspeed", "--deepspeed-python", "{ds}"), timeout_s=1800),
    ]


def plan_full(ram: int) -> list[Bench]:
    state = -(-int(ram * 1.05) // GiB)   # GiB, rounded up: larger than RAM
    return [
        Bench("io", "I/O at 8 GiB: engine vs fio, zarr-python, tensorstore",
              tool("bench_io.py", "--path", "{work}", "--size", "8GiB", "--runs", 3),
              disk_bytes=45 * GiB, timeout_s=3 * 3600),
        Bench("store", f"tiered store, {state} GiB state (larger than RAM), 2 GiB pool",
              tool("bench_store.py", "--path", "{work}", "--state", f"{state}GiB",
                   "--cpu-budget", "2GiB", "--bucket", "64MiB", "--steps", 3, "--fio-runs", 3),
              needs=("fio",), disk_bytes=(state + 2) * GiB, timeout_s=4 * 3600),
        step_bench("134m", 768, 12, "muon", ["--steps", 5, "--warmup", 1], 3 * 3600),
        step_bench("134m", 768, 12, "adamw", ["--steps", 5, "--warmup", 1], 3 * 3600),
        step_bench("1b", 2048, 17, "muon", ["--steps", 3, "--warmup", 1], 8 * 3600),
        step_bench("1b", 2048, 17, "adamw", ["--steps", 3, "--warmup", 1], 8 * 3600),
        Bench("checkpoint", "checkpoint stall, 105.8 M model",
              tool("bench_checkpoint.py", "--path", "{work}", "--batch", 2, "--seq", 64, "--runs", 5),
              needs=("fio",), timeout_s=3 * 3600),
        *checkpoint_chain("270m", 2.7e8, [], ["--runs", 3], 3 * 3600),
        *checkpoint_chain("2700m", 2.7e9, [], ["--runs", 3], 8 * 3600),
        Bench("inspect", "inspect: 50,000 tensors listed, 1.5 GiB --stats",
              tool("bench_inspect.py", "--path", "{work}"), needs=("fio",), timeout_s=3600),
        Bench("startup", "start-up: plan vs import torch", tool("bench_startup.py", "--runs", 5),
              timeout_s=1800),
        # at least 3 B parameters, and more where this machine's RAM needs it for the state
        # to exceed RAM (1.1x; the Muon rule's 8 B per parameter takes 3.4 B at 25 GB)
        *train_large_benches(ram),
    ]


def train_large_benches(ram: int) -> list[Bench]:
    """--full's two runs of bench_train_large (all-AdamW, Muon rule) against DeepSpeed."""
    disk = max(int(3e9 * 12), int(ram * 1.1)) * 11 // 10   # the state, and a tenth more
    return [
        Bench("train_large_adamw", "training, >= 3 B, all-AdamW, state on NVMe larger than RAM",
              tool("bench_train_large.py", "--path", "{work}", "--params", 3e9,
                   "--state-over-ram", 1.1, "--rule", "adamw", "--steps", 3),
              deepspeed=("--peer", "deepspeed", "--deepspeed-python", "{ds}"),
              disk_bytes=disk, timeout_s=12 * 3600),
        Bench("train_large_muon", "training, >= 3 B, Muon rule, state on NVMe larger than RAM",
              tool("bench_train_large.py", "--path", "{work}", "--params", 3e9,
                   "--state-over-ram", 1.1, "--rule", "muon", "--steps", 1),
              deepspeed=("--peer", "deepspeed", "--deepspeed-python", "{ds}"),
              disk_bytes=disk, timeout_s=12 * 3600),
    ]


# -- the machine --------------------------------------------------------------------------------
def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def disk_facts(path: str) -> dict:
    """The file system under ``path``: its mount, device, type, size and free bytes, and
    the device's model and whether it rotates (from /sys, where it says)."""
    path = os.path.realpath(path)
    mount = ("/", "?", "?")
    for line in (_read("/proc/mounts") or "").splitlines():
        dev, mnt, fstype = line.split()[:3]
        if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(mount[0]):
            mount = (mnt, dev, fstype)
    usage = shutil.disk_usage(path)
    facts = {"path": path, "mount": mount[0], "device": mount[1], "fstype": mount[2],
             "total_bytes": usage.total, "free_bytes": usage.free}
    block = os.path.basename(mount[1])
    sys_block = f"/sys/class/block/{block}"
    if os.path.exists(os.path.join(sys_block, "partition")):   # a partition: its disk's facts
        sys_block = os.path.dirname(os.path.realpath(sys_block))
    facts["model"] = _read(os.path.join(sys_block, "device", "model"))
    facts["rotational"] = _read(os.path.join(sys_block, "queue", "rotational"))
    facts["scheduler"] = _read(os.path.join(sys_block, "queue", "scheduler"))
    return facts


def machine_facts(path: str) -> dict:
    import psutil
    cpuinfo = _read("/proc/cpuinfo") or ""
    model = next((l.split(":", 1)[1].strip() for l in cpuinfo.splitlines()
                  if l.startswith("model name")), platform.processor() or None)
    return {"cpu_model": model, "cores": os.cpu_count(), "ram_bytes": psutil.virtual_memory().total,
            "disk": disk_facts(path), "kernel": platform.release(),
            "python": platform.python_version(), "platform": platform.platform()}


def git_commit() -> dict:
    def git(*a):
        p = subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True, timeout=60)
        return p.stdout.strip() if p.returncode == 0 else None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def _python_imports(python: str, modules: str) -> str | None:
    """Why ``python`` cannot ``import modules`` (its last line of error), or None."""
    try:
        ok = subprocess.run([python, "-c", f"import {modules}"], capture_output=True,
                            text=True, timeout=600, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python}: {e}"
    if ok.returncode == 0:
        return None
    return f"{python} cannot import {modules}: {(ok.stderr.strip().splitlines() or ['?'])[-1]}"


def find_peers(deepspeed_python: str | None) -> dict:
    """What is available: {"fio": why-not or None, "time": ..., "deepspeed": ...,
    "zero_to_fp32": ..., ...}: DeepSpeed's zero_to_fp32 also needs huggingface_hub and
    safetensors for the sharded safetensors output it is compared on."""
    missing = {"fio": None if shutil.which("fio") else "fio is not installed (apt-get install fio)",
               "time": None if os.path.exists("/usr/bin/time")
               else "/usr/bin/time is missing (apt-get install time)"}
    for module in ("tensorstore", "zarr"):
        missing[module] = None if importlib.util.find_spec(module) else f"{module} is not installed"
    if not deepspeed_python:
        missing["deepspeed"] = (f"no interpreter with deepspeed: pass --deepspeed-python or set "
                                f"{DEEPSPEED_PYTHON_ENV}")
    else:
        missing["deepspeed"] = _python_imports(deepspeed_python, "deepspeed")
    missing["zero_to_fp32"] = missing["deepspeed"] or _python_imports(
        deepspeed_python, "huggingface_hub, safetensors")
    return missing


# -- one benchmark ------------------------------------------------------------------------------
def command_of(argv: list[str], fill: dict) -> str:
    """The command line (shell-quoted) with ``{path}``, ``{work}`` and ``{ds}`` filled in."""
    return shlex.join(a.format(**fill) for a in argv)


def too_little_disk(b: Bench, path: str) -> str | None:
    """Why ``b`` cannot run for want of free disk at ``path`` (measured now), or None: what
    it writes, and its input where that is still to be made."""
    free = shutil.disk_usage(path).free
    need = b.disk_bytes
    if b.input_dir and not os.path.exists(os.path.join(b.input_dir.format(path=path), "latest")):
        need += b.input_bytes
    if need > free:
        return f"needs about {need / 1e9:.0f} GB free at --path, {free / 1e9:.0f} GB there"
    return None


def plan_entry(b: Bench, missing: dict, fill: dict) -> dict:
    """What would run for ``b``: its commands, or why it is skipped; peers left out."""
    entry = {"title": b.title}
    why = [missing[n] for n in b.needs if missing.get(n)]
    if why:
        entry.update(status="skipped", why="; ".join(why))
    argv = list(b.argv)
    if b.deepspeed:
        if missing.get(b.peer):
            entry["peers_skipped"] = {b.peer: missing[b.peer]}
            argv += list(b.no_deepspeed)
        else:
            argv += list(b.deepspeed)
    entry["before"] = [command_of(c, fill) for c in b.before]
    entry["command"] = command_of(argv, fill)
    entry["after"] = [command_of(c, fill) for c in b.after]
    entry["timeout_s"] = b.timeout_s
    if b.name == "io":
        skipped = {m: missing[k] for m, k in (("tensorstore", "tensorstore"),
                                              ("zarr_python", "zarr")) if missing.get(k)}
        if missing.get("fio"):
            skipped["fio"] = missing["fio"] + "; its O_DIRECT loop is the baseline"
        if skipped:
            entry["peers_skipped"] = skipped
    return entry


def parse_json(stdout: str):
    """The JSON object a tool printed (the whole output, or from its first ``{``)."""
    for text in (stdout, stdout[stdout.find("{"):] if "{" in stdout else ""):
        try:
            return json.loads(text)
        except ValueError:
            continue
    return None


def run_entry(b: Bench, entry: dict, log) -> dict:
    """Run an entry's commands; adds status, wall time, load averages and the tool's JSON."""
    entry["loadavg_before"] = os.getloadavg()
    t0 = time.perf_counter()
    for cmd in entry["before"]:
        rc, out, err = run_group(shlex.split(cmd), b.timeout_s)
        if rc != 0:
            entry.update(status="failed", why=f"{cmd[:120]}: exit code {rc}",
                         output_tail=(err or out).strip().splitlines()[-20:])
            return entry
    log(f"  {entry['command']}")
    rc, out, err = run_group(shlex.split(entry["command"]), b.timeout_s)
    entry["wall_s"] = time.perf_counter() - t0
    entry["result"] = parse_json(out)
    if rc != 0 or entry["result"] is None:
        why = f"timed out after {b.timeout_s:.0f} s" if rc is None else f"exit code {rc}"
        entry.update(status="failed", why=why + ("" if entry["result"] else ", no JSON"),
                     output_tail=(err or out).strip().splitlines()[-20:])
    else:
        entry["status"] = "ok"
    for cmd in entry["after"]:
        run_group(shlex.split(cmd), b.timeout_s)
    entry["loadavg_after"] = os.getloadavg()
    return entry


# -- the driver ---------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    for m in ("quick", "full", "tiny"):
        mode.add_argument(f"--{m}", dest="mode", action="store_const", const=m)
    p.add_argument("--path", default=None,
                   help="folder on the disk under test (scratch and checkpoints; default: a "
                        "temporary folder)")
    p.add_argument("--out", default=None,
                   help="folder for bench_all.json and bench_all.md (default: bench_all-<mode>-<time>)")
    p.add_argument("--only", default=None, help="comma-separated benchmark names")
    p.add_argument("--deepspeed-python", default=os.environ.get(DEEPSPEED_PYTHON_ENV),
                   help=f"interpreter with deepspeed 0.19.8 (default ${DEEPSPEED_PYTHON_ENV}; "
                        "'' to run without DeepSpeed)")
    p.add_argument("--resume", action="store_true",
                   help="carry on the run in --out: keep its benchmarks that finished ok and run "
                        "the rest (those named by --only again); the report is written after "
                        "each benchmark, so a run cut short loses nothing")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (commands, what is skipped and why) as JSON; run nothing")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    log = lambda msg: print(f"bench_all: {msg}", file=sys.stderr, flush=True)
    if args.resume and not args.out:
        print("bench_all: --resume needs --out (the folder of the run to carry on)", file=sys.stderr)
        return 2
    made_path = args.path is None
    path = os.path.abspath(args.path or tempfile.mkdtemp(prefix="bench_all."))
    os.makedirs(path, exist_ok=True)
    out = os.path.abspath(args.out or f"bench_all-{args.mode}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        machine = machine_facts(path)
        benches = {"tiny": plan_tiny, "quick": plan_quick,
                   "full": lambda: plan_full(machine["ram_bytes"])}[args.mode]()
        wanted = set(args.only.split(",")) if args.only else None
        if wanted:
            unknown = wanted - {b.name for b in benches}
            if unknown:
                print(f"bench_all: no benchmark named {sorted(unknown)} in --{args.mode}: "
                      f"{[b.name for b in benches]}", file=sys.stderr)
                return 2
            if not args.resume:
                benches = [b for b in benches if b.name in wanted]
        previous = load_previous(out, args.mode, machine) if args.resume else {}
        kept = {n: e for n, e in previous.get("benchmarks", {}).items() if e.get("status") == "ok"}
        missing = find_peers(args.deepspeed_python)
        fill = {"path": path, "ds": args.deepspeed_python or ""}
        session = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git": git_commit(),
                   "loadavg_before": os.getloadavg()}
        report = {"mode": args.mode, "date": previous.get("date", session["date"]),
                  "git": session["git"], "machine": machine,
                  "missing": {k: v for k, v in missing.items() if v},
                  "loadavg_before": session["loadavg_before"], "benchmarks": {},
                  "sessions": previous.get("sessions", []) + [session]}
        to_run = []
        for b in benches:
            entry = plan_entry(b, missing, {**fill, "work": os.path.join(path, b.name)})
            if b.name in kept and not (wanted and b.name in wanted):
                entry = kept[b.name]   # measured by an earlier session of this run
            elif wanted and b.name not in wanted:   # --resume --only: the rest waits
                entry = previous.get("benchmarks", {}).get(b.name) or {
                    **entry, "status": "pending", "why": "not run yet (--only)"}
            else:
                to_run.append(b)
                disk = too_little_disk(b, path)
                if disk and args.dry_run:   # when running, free space is measured before each
                    entry.update(status="skipped", why="; ".join(filter(None, [entry.get("why"), disk])))
            report["benchmarks"][b.name] = entry
        if args.dry_run:
            report["dry_run"] = True
            report["loadavg_after"] = os.getloadavg()
            print(json.dumps(report, indent=2))
            return 0
        for b in to_run:
            entry = report["benchmarks"][b.name]
            disk = too_little_disk(b, path)
            if disk:
                entry.update(status="skipped", why="; ".join(filter(None, [entry.get("why"), disk])))
            if entry.get("status") == "skipped":
                log(f"{b.name}: skipped ({entry['why']})")
                for cmd in entry["after"]:   # its clean-up still frees the disk for the next
                    run_group(shlex.split(cmd), b.timeout_s)
                continue
            work = os.path.join(path, b.name)
            os.makedirs(work, exist_ok=True)
            log(f"{b.name}: {b.title}")
            entry.update(date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), git=session["git"])
            run_entry(b, entry, log)
            shutil.rmtree(work, ignore_errors=True)
            if entry["status"] == "ok":
                entry["headline"] = headline(b.name, entry["result"])
            log(f"{b.name}: {entry['status']} in {entry.get('wall_s', 0):.0f} s: "
                f"{entry.get('headline') or entry.get('why')}")
            report["loadavg_after"] = session["loadavg_after"] = os.getloadavg()
            write_report(out, report)   # a run cut short keeps what it measured (--resume)
        report["loadavg_after"] = session["loadavg_after"] = os.getloadavg()
    finally:
        if made_path:
            shutil.rmtree(path, ignore_errors=True)
    text = write_report(out, report)
    print(text)
    log(f"wrote {out}/bench_all.json and bench_all.md")
    return 1 if any(e.get("status") == "failed" for e in report["benchmarks"].values()) else 0

if __name__ == "__main__":
    sys.exit(main())
