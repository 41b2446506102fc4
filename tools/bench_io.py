#!/usr/bin/env python3
"""Disk throughput of the engine against fio, zarr-python and tensorstore; prints JSON.

Usage: python tools/bench_io.py --path DIR [--size 2GiB] [--block-size 8MiB]
       [--queue-depth N] [--chunk-size 64MiB] [--runs 3] [--baseline auto|fio|odirect_loop]
       [--keep] [--smoke]

The same code as `offload-engine bench io --json` (offload_engine/cli/bench_io.py); exit
code 2 with one line on stderr when DIR cannot be used. docs/benchmarks.md explains the
methods and how the page cache is kept out.

--smoke runs the same code at tiny sizes (16 MiB in 4 MiB chunk files, 1 MiB requests,
one run; flags given after it win) in seconds and prints the same JSON: the test suite
runs it so the tool cannot rot. Its figures mean nothing.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offload_engine.cli.main import main  # noqa: E402

# --smoke: the sizes it sets, before the caller's own flags (argparse: the last one wins)
SMOKE = ["--size", "16MiB", "--chunk-size", "4MiB", "--block-size", "1MiB", "--runs", "1"]

if __name__ == "__main__":
    argv = sys.argv[1:]
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        sys.exit(0)
    smoke = SMOKE if "--smoke" in argv else []
    sys.exit(main(["bench", "io", "--json", *smoke, *(a for a in argv if a not in ("--json", "--smoke"))]))
