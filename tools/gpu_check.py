#!/usr/bin/env python3
"""What only a GPU can show, in one short run that prints JSON (tools/gpu_check.sh runs it).

Sections, each independent (a failure is recorded with its error and the next one runs):

- ``parity``: ZeroMuon against ``torch.optim.Muon`` + ``torch.optim.AdamW`` (single-tensor
  path, ``foreach=False``) on the same device, same gradients, several steps, odd shapes:
  whether every parameter is bitwise equal, and otherwise the largest difference in units
  in the last place (ulp) per parameter.
- ``copies``: host-to-device and device-to-host GB/s of the store's pinned pool
  (``io.BufferPool``) against torch copies from pageable and from pinned tensors.
- ``step``: ZeroMuon's step at world size 1 with the state homed on the local disk, in
  pinned host memory and in GPU memory: median step time and the share of it spent
  waiting for the store (``StepStats.store_io_wait_s``).
- ``gpu_tier``: the store's GPU tier: an array homed on the GPU, acquired on CUDA, hits
  and the bytes it moved over PCIe (none).
- ``gpu_staging``: every CUDA path of the store's GPU tier (store/gpu_staging.py): NVMe
  buckets staged on the GPU through a pool and an arena too small for them (side-stream
  copies both ways, extents reused, write-backs waiting for their copy-outs on the copy
  waiter thread, clean buckets dropped after their copy-ins), a CPU user after a CUDA one,
  a gpu-home bucket placed where a copy-out is pending, a snapshot taken while copy-outs
  are on their way; the bytes are checked in memory and, reopened without a GPU, on disk;
  the events made (reused: at most 16) and the pool's pinning.
- ``dcp_memory``: ``dcp.save`` / ``dcp.load`` (torchtitan's flattened flow) of a CUDA model's
  ZeroMuon state, 32 times its largest parameter's: the growth of the host's peak RSS
  (tests/helpers/dcp_memory.py in its own process), which must stay a small part of the state.
  DCP's writer keeps every tensor it wrote in host memory until the rank's file is written;
  the state's lazy tensors hand it host tensors that hold no bytes. A CUDA model's own
  parameters are staged by DCP whatever the optimizer (in ``save_growth``), so the bound
  applies to the state saved alone (``state_save_growth``) and to the load.

Exit 1 when a section raised, or reports ``"correct": false`` or ``"bounded": false``.

Without CUDA, ``parity`` and ``step`` run on the CPU at a small size (their CUDA halves are
reported as skipped) so the script itself is exercised anywhere.

    python tools/gpu_check.py --path /local/nvme/dir [--size small|full] > gpu_check.json

``--smoke`` runs every section at a tiny size (seconds; the test suite runs it so the script
cannot rot), ``--list`` prints the sections' names (JSON) and runs nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from offload_engine.io import BufferPool  # noqa: E402
from offload_engine.optim import ZeroMuon, default_use_muon  # noqa: E402
from offload_engine.store import TieredStore  # noqa: E402

MiB = 1 << 20
PARITY_SHAPES = {"embed_tokens": (50, 24), "w_tall": (96, 32), "w_wide": (32, 160),
                 "w_odd": (37, 23), "w_row": (1, 65), "norm_weight": (24,), "lm_head": (50, 24)}
MUON = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95}
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}


class Bag(nn.Module):
    def __init__(self, shapes: dict, device, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.randn(shape, generator=g).to(device)))


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between float32 ``a`` and ``b`` in units in the last place."""
    def ordered(x):
        bits = x.float().contiguous().view(torch.int32).long()
        mag = bits & 0x7FFFFFFF
        return torch.where(bits < 0, -mag, mag)
    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def section(fn, *args):
    t0 = time.perf_counter()
    try:
        out = fn(*args)
    except Exception as e:  # recorded, so one failure does not hide the other sections
        out = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def check_parity(device: str, tmp: str, steps: int = 4) -> dict:
    model = Bag(PARITY_SHAPES, device)
    ref = Bag(PARITY_SHAPES, device)
    store = {"nvme_paths": [os.path.join(tmp, "parity")], "bucket_bytes": 64 * 1024,
             "cpu_budget": 64 * 64 * 1024, "prefetch_depth": 2}
    muon_ref = [p for n, p in ref.named_parameters() if default_use_muon(n, p)]
    adam_ref = [p for n, p in ref.named_parameters() if not default_use_muon(n, p)]
    refs = [torch.optim.Muon(muon_ref, **MUON),
            torch.optim.AdamW(adam_ref, **ADAMW, foreach=False)]
    g = torch.Generator().manual_seed(7)
    with ZeroMuon(model.named_parameters(), **MUON, adamw=dict(ADAMW), store=store) as opt:
        for _ in range(steps):
            for p, q in zip(model.parameters(), ref.parameters()):
                grad = torch.randn(p.shape, generator=g).to(device)
                p.grad, q.grad = grad.clone(), grad.clone()
            opt.step()
            for o in refs:
                o.step()
    per = {n: ulp_distance(p.detach(), q.detach())
           for (n, p), q in zip(model.named_parameters(), ref.parameters())}
    return {"device": device, "steps": steps, "bitwise": all(v == 0 for v in per.values()),
            "max_ulp_per_param": per}


def _gbps(nbytes: int, fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return round(nbytes / statistics.median(times) / 1e9, 2)


def check_copies(nbytes: int) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    with BufferPool(nbytes) as pool:
        buf = pool.acquire(nbytes)
        ours = buf.bytes
        out = {"bytes": nbytes, "pool_pinned": bool(pool.pinned),
               "h2d_gbps": {"pool": _gbps(nbytes, lambda: dev.copy_(ours, non_blocking=True)),
                            "torch_pinned": _gbps(nbytes, lambda: dev.copy_(pinned, non_blocking=True)),
                            "torch_pageable": _gbps(nbytes, lambda: dev.copy_(pageable))},
               "d2h_gbps": {"pool": _gbps(nbytes, lambda: ours.copy_(dev, non_blocking=True)),
                            "torch_pinned": _gbps(nbytes, lambda: pinned.copy_(dev, non_blocking=True)),
                            "torch_pageable": _gbps(nbytes, lambda: pageable.copy_(dev))}}
        buf.release()
    return out


def _step_model(device: str, layers: int, dim: int) -> nn.Module:
    shapes = {"embed_tokens": (4 * dim, dim), "lm_head": (4 * dim, dim)}
    for i in range(layers):
        shapes[f"l{i}_attn"] = (dim, dim)
        shapes[f"l{i}_mlp"] = (4 * dim, dim)
        shapes[f"l{i}_norm"] = (dim,)
    return Bag(shapes, device, seed=1)


def check_step(device: str, tmp: str, layers: int, dim: int, steps: int) -> dict:
    homes = {"nvme": {"default_home": "nvme"}, "cpu": {"default_home": "cpu"}}
    if device == "cuda":
        homes["gpu"] = {"default_home": "gpu"}
    model = _step_model(device, layers, dim)
    state_bytes = sum(p.numel() for p in model.parameters()) * 4 * 2  # momentum or m+v, about
    bucket = 8 * MiB if dim >= 1024 else 256 * 1024
    out = {"device": device, "params": sum(p.numel() for p in model.parameters()), "homes": {}}
    for home, cfg in homes.items():
        store = dict(cfg, bucket_bytes=bucket, prefetch_depth=4,
                     nvme_paths=[os.path.join(tmp, f"step-{home}")],
                     cpu_budget=(state_bytes + 64 * bucket) if home == "cpu" else 64 * bucket,
                     gpu_budget=(state_bytes + 64 * bucket) if home == "gpu" else 0)
        times, waits = [], []
        with ZeroMuon(model.named_parameters(), **MUON, adamw=dict(ADAMW), store=store) as opt:
            g = torch.Generator(device=device).manual_seed(3)
            for i in range(steps + 1):
                for p in model.parameters():
                    p.grad = torch.randn(p.shape, generator=g, device=device)
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                opt.step()
                if device == "cuda":
                    torch.cuda.synchronize()
                if i:  # the first step creates the state: not measured
                    times.append(time.perf_counter() - t0)
                    waits.append(opt.last_step_stats.store_io_wait_s)
        step_s = statistics.median(times)
        out["homes"][home] = {"step_s": round(step_s, 4),
                              "io_wait_share": round(statistics.median(waits) / step_s, 3)}
    return out


def check_gpu_tier(tmp: str) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    cfg = {"nvme_paths": [os.path.join(tmp, "tier")], "bucket_bytes": MiB, "cpu_budget": 8 * MiB,
           "gpu_budget": 64 * MiB, "homes": {"g": "gpu"}}
    with TieredStore(cfg) as store:
        store.register("g", torch.float32, 16 * MiB // 4)
        for _ in range(2):
            for b in range(16):
                h = store.acquire("g", b, device="cuda")
                h.tensor.add_(1)
                store.release(h, dirty=True)
        torch.cuda.synchronize()
        h = store.acquire("g", 0, device="cuda")
        value = float(h.tensor[0])
        store.release(h)
        stats = store.stats().as_dict()
    return {"value_after_two_passes": value, "correct": value == 2.0, "stats": stats}


def _thread_names() -> set[str]:
    return {t.name for t in threading.enumerate()}


def check_gpu_staging(tmp: str, buckets: int) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    bucket = MiB
    n = bucket // 4
    path = os.path.join(tmp, "staging")
    cfg = {"nvme_paths": [path], "bucket_bytes": bucket, "cpu_budget": 6 * bucket,
           "gpu_budget": 4 * bucket, "prefetch_depth": 2}
    failures, snapped = [], {}

    def expect(what: str, got, want) -> None:
        if got != want:
            failures.append(f"{what}: {got} != {want}")

    def cuda_step(store, dirty: bool) -> None:
        order = store.begin_step() or [("m", i) for i in range(buckets)]
        for key in order:
            h = store.acquire(*key, device="cuda")
            if dirty:
                h.tensor.add_(1)       # a kernel on the compute stream, after the copy-in
            store.release(h, dirty=dirty)

    def host_values(store, name: str, count: int) -> list[float]:
        out = []
        for i in range(count):
            h = store.acquire(name, i)
            out.append(float(h.tensor[0]) if bool((h.tensor == h.tensor[0]).all()) else -1.0)
            store.release(h)
        return out

    with TieredStore(cfg) as store:
        store.register("m", torch.float32, buckets * n)
        store.register("c", torch.float32, n, home="cpu")
        store.register("g", torch.float32, n, home="gpu")
        for _ in range(3):
            cuda_step(store, dirty=True)
        cuda_step(store, dirty=False)  # clean: dropped once their copy-ins have read them
        h = store.acquire("c", 0, device="cuda")
        h.tensor.fill_(7)
        store.release(h, dirty=True)
        expect("cpu user after a cuda user", host_values(store, "c", 1), [7.0])
        cuda_step(store, dirty=True)   # copy-outs still on their way ...
        h = store.acquire("g", 0, device="cuda")  # ... when g is placed
        zeros = int(h.tensor.count_nonzero()) == 0
        h.tensor.fill_(9)
        store.release(h, dirty=True)
        expect("gpu-home bucket zeroed", zeros, True)
        cuda_step(store, dirty=True)   # and while a snapshot starts
        snap = store.snapshot(lambda name, i, start, t: snapped.__setitem__(
            (name, i), float(t[0].item())), arrays=["m", "g"])
        snap.wait(120)
        expect("snapshot of m", [snapped[("m", i)] for i in range(buckets)], [5.0] * buckets)
        expect("snapshot of g", snapped[("g", 0)], 9.0)
        store.flush()
        expect("m in memory", host_values(store, "m", buckets), [5.0] * buckets)
        expect("copy waiter running", "oe-copy-wait" in _thread_names(), True)
        stats = store.stats().as_dict()
        events = store.gpu.events.created
        pinned = bool(store.pool.pinned)
    expect("copy waiter ended", "oe-copy-wait" in _thread_names(), False)
    with TieredStore({**cfg, "gpu_budget": 0}) as store:
        store.register("m", torch.float32, buckets * n)
        expect("m on disk", host_values(store, "m", buckets), [5.0] * buckets)
    if events > 16:
        failures.append(f"{events} CUDA events made: they are not reused")
    return {"buckets": buckets, "correct": not failures, "failures": failures,
            "events_created": events, "pool_pinned": pinned, "stats": stats}


def check_dcp_memory(tmp: str) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA (tests/optim/test_zero_muon_dcp.py measures the CPU case)"}
    import subprocess
    env = dict(os.environ, PYTHONWARNINGS="ignore", MALLOC_MMAP_THRESHOLD_="131072",
               PYTHONPATH=os.pathsep.join(  # helpers.*, and the caller's path kept
                   p for p in (ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH"))
                   if p))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "helpers", "dcp_memory.py"),
                          os.path.join(tmp, "dcp"), "cuda"],
                         capture_output=True, text=True, env=env, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    m = json.loads(out.stdout.strip().splitlines()[-1])
    # DCP stages a CUDA model's parameters in host memory (torch's writer, not ours): the
    # bound is on the state saved alone and on the load
    m["bounded"] = all(m[k] < m["state_bytes"] // 4 for k in ("state_save_growth", "load_growth"))
    return m


def sections(device: str, tmp: str, size: str) -> dict:
    """The checks in the order they run: section name -> (check function, its arguments).
    ``size``: "full", "small" or "smoke" (the step model's layers, width and steps, the
    copies' bytes)."""
    layers, dim, steps = {"full": (16, 2048, 5), "small": (4, 128, 3), "smoke": (1, 32, 2)}[size]
    copy_bytes = 8 * MiB if size == "smoke" else 512 * MiB
    return {
        "parity": (check_parity, device, tmp),
        "copies": (check_copies, copy_bytes),
        "step": (check_step, device, tmp, layers, dim, steps),
        "gpu_tier": (check_gpu_tier, tmp),
        "gpu_staging": (check_gpu_staging, tmp, 6 if size == "smoke" else 16),
        "dcp_memory": (check_dcp_memory, tmp),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", default=None, help="directory on the local disk (default: a temp dir)")
    ap.add_argument("--size", choices=("small", "full"), default=None,
                    help="model size for the step section (default: full with CUDA, small without)")
    ap.add_argument("--smoke", action="store_true",
                    help="every section at a tiny size, in seconds (what the test suite runs)")
    ap.add_argument("--list", action="store_true", help="print the sections' names (JSON), run nothing")
    ap.add_argument("--sections", default=None,
                    help="comma-separated names of the sections to run (default: all)")
    ap.add_argument("--out", default=None,
                    help="also rewrite the report to this file after each section, so a run "
                         "cut off by a time limit keeps the sections it finished")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    size = "smoke" if args.smoke else (args.size or ("full" if cuda else "small"))
    device = "cuda" if cuda else "cpu"
    if args.list:
        print(json.dumps(list(sections(device, "", size))))
        return 0
    tmp = tempfile.mkdtemp(prefix="gpu-check-", dir=args.path)
    try:
        report = {
            "machine": {"python": platform.python_version(), "torch": torch.__version__,
                        "cuda": cuda, "gpu": torch.cuda.get_device_name(0) if cuda else None,
                        "path": tmp, "size": size},
        }
        chosen = sections(device, tmp, size)
        if args.sections:
            names = args.sections.split(",")
            unknown = sorted(set(names) - set(chosen))
            if unknown:
                ap.error(f"unknown sections {unknown}; the sections are {list(chosen)}")
            chosen = {n: chosen[n] for n in names}
        for name, (fn, *fn_args) in chosen.items():
            report[name] = section(fn, *fn_args)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(report, f, indent=2)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(report, indent=2))
    failed = [k for k, v in report.items() if k != "machine"
              and ("error" in v or v.get("correct") is False or v.get("bounded") is False)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
