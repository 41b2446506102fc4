#!/usr/bin/env python3
"""Disk throughput of the engine against fio, zarr-python and tensorstore; prints JSON.

Usage: python tools/bench_io.py --path DIR [--size 2GiB] [--block-size 8MiB]
       [--queue-depth N] [--chunk-size 64MiB] [--runs 3] [--baseline auto|fio|odirect_loop]
       [--keep]

The same code as `offload-engine bench io --json` (offload_engine/cli/bench_io.py); exit
code 2 with one line on stderr when DIR cannot be used. docs/benchmarks.md explains the
methods and how the page cache is kept out.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offload_engine.cli.main import main  # noqa: E402

if __name__ == "__main__":
    argv = sys.argv[1:]
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        sys.exit(0)
    sys.exit(main(["bench", "io", "--json", *(a for a in argv if a != "--json")]))
