#!/usr/bin/env python3
"""What a checkpoint costs the training loop: a blocking save against an asynchronous one
(``save_checkpoint_async``) on the same run, against the disk's fio write bandwidth in the
same run (JSON).

One process trains a decoder (bench_step's model: a 32000 x dim embedding and output
head, ``layers`` blocks of Muon matrices; about 106 M parameters by default) with ZeroMuon,
state homed on NVMe through a pinned pool of a quarter of the state, so the state streams
every step as in a real offloaded run. After warm-up:

- ``baseline``: training iterations (forward, backward, ``step()``), no save: median time;
- ``blocking``: ``save_checkpoint`` between two iterations: its wall time is what training
  loses (and its CPU seconds, all threads: on a host whose cores the training keeps busy,
  an asynchronous save cannot cost less than that);
- ``async``: ``save_checkpoint_async`` between two iterations, then iterations go on until
  the generation is committed. What training loses is the call's own time plus the
  iterations' time beyond the baseline while the save runs (``extra_s``); ``exposed`` is
  that over the blocking save's time (0: fully hidden, 1: no better than blocking).
  Peak RSS is sampled every 5 ms while the save runs and compared with the peak of the
  baseline iterations (the pinned pool is allocated up front, and an iteration's
  activations and gradients come and go: the difference is what the save costs).

Each mode runs ``--runs`` times (alternating); medians are reported. The generation's
bytes over the blocking save's time give its GB/s, next to fio's sequential O_DIRECT write.

    python tools/bench_checkpoint.py --path /nvme/bench --runs 3

``--smoke`` runs the same code at tiny sizes (a 2-block model of width 64, 16 KiB buckets,
one run of each mode, an 8 MiB fio file) in seconds and prints the same JSON: the test
suite runs it so the tool cannot rot. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import psutil  # noqa: E402
import torch  # noqa: E402

from bench_step import build_model, loss_of  # noqa: E402
from bench_store import fio_mixed_gbps  # noqa: E402
from offload_engine.checkpoint import save_checkpoint, save_checkpoint_async  # noqa: E402
from offload_engine.optim import ZeroMuon, default_use_muon  # noqa: E402
from offload_engine.units import parse_bytes  # noqa: E402


class RssSampler:
    """Peak resident set size of this process while running (bytes)."""

    def __init__(self, period_s: float = 0.005):
        self.proc = psutil.Process()
        self.period_s = period_s
        self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.period_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


# --smoke: the sizes it sets (everything else as given)
SMOKE = {"dim": 64, "layers": 2, "vocab": 256, "batch": 1, "seq": 8, "bucket": 16 << 10,
         "warmup": 1, "baseline_iters": 2, "runs": 1, "fio_size": 8 << 20, "fio_runs": 1}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", required=True, help="a directory on the disk to measure")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--bucket", type=parse_bytes, default=parse_bytes("16MiB"))
    p.add_argument("--pool-fraction", type=float, default=0.25,
                   help="pinned pool as a fraction of the state (default 0.25)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--baseline-iters", type=int, default=5)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--fio-size", type=parse_bytes, default=parse_bytes("1GiB"))
    p.add_argument("--fio-runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, seconds, the same code and JSON (figures mean nothing)")
    args = p.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    if args.threads:
        torch.set_num_threads(args.threads)

    work = os.path.join(os.path.abspath(args.path), "bench_checkpoint")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    try:
        fio = fio_mixed_gbps(work, args.fio_size, 8 << 20, 8, args.fio_runs)
        result = run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["fio"] = {"write_gbps": fio["write"]["gbps"], "write_runs": fio["write"]["runs"],
                     "read_gbps": fio["read"]["gbps"], "args": fio["args"] + " --rw=write"}
    result["blocking"]["gbps_vs_fio_write"] = result["blocking"]["gbps"] / fio["write"]["gbps"]
    result["environment"] = {"python": platform.python_version(), "torch": torch.__version__,
                             "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                             "loadavg": list(os.getloadavg())}
    print(json.dumps(result, indent=2))
    return 0


def run(args, work: str) -> dict:
    model = build_model(args.vocab, args.dim, args.layers)
    n_params = sum(p.numel() for p in model.parameters())
    state_bytes_guess = 0
    for name, p in model.named_parameters():  # Muon: momentum; AdamW: two moments (fp32)
        state_bytes_guess += p.numel() * 4 * (1 if default_use_muon(name, p) else 2)
    pool = max(int(state_bytes_guess * args.pool_fraction), 8 * args.bucket)
    opt = ZeroMuon(model.named_parameters(), lr=0.02, adamw={"lr": 3e-4},
                   store={"nvme_paths": [os.path.join(work, "state")], "cpu_budget": pool,
                          "bucket_bytes": args.bucket, "prefetch_depth": 4})
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    ck = os.path.join(work, "ck")
    step = 0

    def iteration() -> float:
        nonlocal step
        t0 = time.perf_counter()
        loss_of(model, tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        return time.perf_counter() - t0

    def drop_generations():
        for name in os.listdir(ck) if os.path.isdir(ck) else []:
            if name.startswith("step-"):
                shutil.rmtree(os.path.join(ck, name))

    for _ in range(args.warmup):
        iteration()
    with RssSampler() as rss_base:
        baseline = [iteration() for _ in range(args.baseline_iters)]
    base = statistics.median(baseline)

    blocking, asyncs = [], []
    for _ in range(args.runs):
        iteration()
        t0, c0 = time.perf_counter(), time.process_time()
        gen = save_checkpoint(ck, model, opt, step)
        blocking.append({"save_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                         "bytes": tree_bytes(gen)})
        drop_generations()

        iteration()
        with RssSampler() as rss:
            t0 = time.perf_counter()
            pending = save_checkpoint_async(ck, model, opt, step)
            call_s = time.perf_counter() - t0
            during = []
            while not pending.done():
                during.append(iteration())
            pending.wait()
            commit_s = time.perf_counter() - t0
        st = pending.stats
        asyncs.append({"call_s": call_s, "commit_s": commit_s, "iterations_during": len(during),
                       "iteration_s": during, "extra_s": call_s + sum(during) - len(during) * base,
                       "step_waited_s": st["step_waited_s"], "inline_copies": st["inline_copies"],
                       "state_buckets": st["state_buckets"], "bytes": st["bytes"],
                       "peak_rss_above_training": rss.peak - rss_base.peak})
        drop_generations()
    opt.close()

    med = statistics.median
    save_s = med([b["save_s"] for b in blocking])
    nbytes = blocking[0]["bytes"]
    extra = med([a["extra_s"] for a in asyncs])
    return {
        "model": {"parameters": n_params, "dim": args.dim, "layers": args.layers, "vocab": args.vocab,
                  "tokens_per_iteration": args.batch * args.seq},
        "store": {"bucket_bytes": args.bucket, "cpu_budget": pool},
        "baseline": {"iteration_s": base, "runs": baseline, "peak_rss": rss_base.peak},
        "blocking": {"save_s": save_s, "cpu_s": med([b["cpu_s"] for b in blocking]),
                     "runs": blocking, "checkpoint_bytes": nbytes,
                     "gbps": nbytes / save_s / 1e9},
        "async": {"call_s": med([a["call_s"] for a in asyncs]),
                  "commit_s": med([a["commit_s"] for a in asyncs]),
                  "extra_s": extra, "exposed": extra / save_s,
                  "peak_rss_above_training": med([a["peak_rss_above_training"] for a in asyncs]),
                  "runs": asyncs},
        "notes": ("extra_s = the call's time + iteration time while the save ran - the same number "
                  "of baseline iterations; exposed = extra_s / blocking save_s (medians)"),
    }


if __name__ == "__main__":
    sys.exit(main())
