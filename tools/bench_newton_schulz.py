#!/usr/bin/env python3
"""How close ZeroMuon's Newton-Schulz runs to this CPU's bf16 matrix-multiply rate (JSON).

A compute-bound Muon step is Newton-Schulz: if it already runs at the rate of a plain bf16
``torch.mm`` of the same shapes, no scheduling of ours can make the step faster without
changing the arithmetic (which must stay ``torch.optim.Muon``'s, bit for bit). For the
matrices of bench_step's decoder of width ``--dim`` (q/k/v/o: dim x dim; MLP up and down:
4 dim x dim and dim x 4 dim) it times, at ``--threads`` torch threads (1: what each of
bench_step's two ranks uses on 2 cores):

- ``newton_schulz``: ``muon_math.NewtonSchulz.run``, the step's own code (5 steps);
- ``mm``: ``torch.mm`` of a bf16 (m, n) by (n, m) matrix, m = min dim, n = max dim: the
  Gram product that makes up most of Newton-Schulz's work;

each as GFLOP/s (``owners.ns_flops`` for Newton-Schulz, 2 m^2 n for the product; median of
``--runs``), their ratio, and the Newton-Schulz seconds per rank that ``--layers`` blocks
at ``--world`` ranks cost at that rate (the work split as ``owners.assign_owners`` splits it).

    python tools/bench_newton_schulz.py --dim 768 --layers 12 --world 2

``--smoke`` runs it at width 64 (seconds; figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _median_s(fn, runs: int) -> float:
    fn()   # warm-up: first-touch of buffers, kernel selection
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(rows: int, cols: int, runs: int) -> dict:
    """Newton-Schulz and the plain product for one (rows, cols) matrix: seconds and GFLOP/s."""
    import torch
    from offload_engine.optim.muon_defaults import (DEFAULT_EPS, DEFAULT_NS_COEFFICIENTS,
                                                    DEFAULT_NS_STEPS)
    from offload_engine.optim.muon_math import NewtonSchulz
    from offload_engine.optim.owners import ns_flops
    m, n = sorted((rows, cols))
    ns = NewtonSchulz(rows * cols, m)
    g = torch.Generator().manual_seed(0)
    values = torch.randn(rows, cols, generator=g).bfloat16()

    def newton_schulz():
        ns.input(rows, cols).copy_(values)
        ns.run(rows, cols, DEFAULT_NS_COEFFICIENTS, DEFAULT_NS_STEPS, DEFAULT_EPS)

    a = torch.randn(m, n, generator=g).bfloat16()
    out = torch.empty(m, m, dtype=torch.bfloat16)
    ns_s = _median_s(newton_schulz, runs)
    mm_s = _median_s(lambda: torch.mm(a, a.T, out=out), runs)
    ns_gflops = ns_flops(rows, cols) / ns_s / 1e9
    mm_gflops = 2 * m * m * n / mm_s / 1e9
    return {"shape": [rows, cols], "newton_schulz_s": ns_s, "newton_schulz_gflops": ns_gflops,
            "mm_s": mm_s, "mm_gflops": mm_gflops, "ns_over_mm_rate": ns_gflops / mm_gflops}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=768, help="decoder width (elements)")
    p.add_argument("--layers", type=int, default=12, help="decoder blocks")
    p.add_argument("--world", type=int, default=2, help="ranks the Newton-Schulz work splits over")
    p.add_argument("--threads", type=int, default=1, help="torch threads (per rank)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="width 64, 1 run (figures mean nothing)")
    args = p.parse_args(argv)
    if args.smoke:
        args.dim, args.layers, args.runs = 64, 2, 1
    import torch
    from offload_engine.optim.owners import assign_owners, ns_flops
    torch.set_num_threads(args.threads)
    d = args.dim
    shapes = {"attention (q, k, v, o)": (d, d), "mlp up": (4 * d, d), "mlp down": (d, 4 * d)}
    per_shape = {name: measure(r, c, args.runs) for name, (r, c) in shapes.items()}
    block = [(d, d)] * 4 + [(4 * d, d), (d, 4 * d)]
    owners = assign_owners([block * args.layers], args.world)[0]
    by_shape = {shape: per_shape[name]["newton_schulz_gflops"] for name, shape in shapes.items()}
    seconds = [0.0] * args.world
    for shape, rank in zip(block * args.layers, owners):
        seconds[rank] += ns_flops(*shape) / (by_shape[shape] * 1e9)
    report = {
        "settings": vars(args), "torch": torch.__version__, "per_shape": per_shape,
        "ns_over_mm_rate": {name: m["ns_over_mm_rate"] for name, m in per_shape.items()},
        "model_newton_schulz_s_per_rank": seconds,
        "note": "newton_schulz: the step's own kernel sequence; mm: one bf16 Gram product of "
                "the same shape; a ratio near 1 leaves no headroom short of other arithmetic",
        "loadavg": os.getloadavg(),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
