#!/usr/bin/env python3
"""Whole-process wall time of short commands against ``python -c "import torch"`` (JSON).

A command that only plans or lists should answer in about the time Python takes to start,
not in the seconds torch and ml_dtypes take to import. This runs, in the same invocation
and interleaved (round-robin, so a busy moment of the machine hits every command alike),
``--runs`` fresh processes of each:

- ``python -c pass`` (the interpreter alone), ``import torch``, ``import ml_dtypes``;
- ``offload-engine plan --model <llama-70b config.json> --world-size 64``;
- ``offload-engine inspect`` of a DeepSpeed checkpoint (listing), and ``consolidate --help``.

Reported: every run's seconds, the median per command, and each command's median over
``import torch``'s. Goal (issue 13): plan <= 0.5x ``import torch``.

    python tools/bench_startup.py [--runs 3]

``--smoke``: one run of each command and no untimed warm-up pass (seconds; the same JSON,
whose figures then mean little): the test suite runs it so the tool cannot rot.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOALS = {"plan_over_import_torch_at_most": 0.5}


def commands() -> dict[str, list[str]]:
    py = sys.executable
    script = os.path.join(os.path.dirname(py), "offload-engine")  # what users run
    cli = [script] if os.path.exists(script) else [py, "-m", "offload_engine.cli.main"]
    llama = os.path.join(ROOT, "tests", "fixtures", "hf_configs", "llama-70b.json")
    ds = os.path.join(ROOT, "tests", "fixtures", "deepspeed", "zero3_w4_bf16")
    return {
        "python": [py, "-c", "pass"],
        "import_torch": [py, "-c", "import torch"],
        "import_ml_dtypes": [py, "-c", "import ml_dtypes"],
        "plan_llama70b_w64": cli + ["plan", "--model", llama, "--world-size", "64"],
        "inspect_deepspeed": cli + ["inspect", ds],
        "consolidate_help": cli + ["consolidate", "--help"],
    }


def timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"bench_startup: {' '.join(argv)} failed:\n{proc.stderr}")
    return seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="fresh processes per command (default 3)")
    p.add_argument("--smoke", action="store_true",
                   help="one run per command, no warm-up pass (seconds; figures mean little)")
    args = p.parse_args(argv)
    if args.smoke:
        args.runs = 1
    cmds = commands()
    for argv in cmds.values() if not args.smoke else ():  # warm the byte-code caches once; not timed
        timed(argv)
    runs: dict[str, list[float]] = {name: [] for name in cmds}
    for _ in range(args.runs):
        for name, argv in cmds.items():
            runs[name].append(timed(argv))
    medians = {name: statistics.median(v) for name, v in runs.items()}
    torch_s = medians["import_torch"]
    result = {
        "runs": runs, "median_s": medians,
        "over_import_torch": {name: m / torch_s for name, m in medians.items()},
        "goals": GOALS,
        "goal_met": medians["plan_llama70b_w64"] / torch_s <= GOALS["plan_over_import_torch_at_most"],
        "environment": {"python": platform.python_version(), "machine": platform.machine(),
                        "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
    }
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
