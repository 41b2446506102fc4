"""`offload-engine demo`: until the training demo exists, the I/O benchmark at a small size.

It runs ``bench io`` once (one run, 256 MiB by default) in a temporary folder under the
current directory (or ``--path``), which is removed afterwards, and prints its table.
"""

from __future__ import annotations

import os

from . import bench_io
from ..units import format_bytes


def add_parser(subparsers):
    p = subparsers.add_parser(
        "demo", help="the I/O benchmark at a small size (the training demo is not built yet)",
        description="The training demo is not built yet: this runs the I/O benchmark "
                    "(bench io) once at a small size in a temporary folder.")
    p.add_argument("--path", default=None, metavar="DIR",
                   help="directory to run in (default: the current directory); a temporary "
                        "folder is made there and removed")
    p.add_argument("--size", default=256 << 20, type=bench_io._size_arg,
                   help="bytes moved per method (default 256MiB)")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    path = args.path if args.path is not None else os.getcwd()
    print(f"The training demo is not built yet; running the I/O benchmark instead at a small "
          f"size ({format_bytes(args.size)}, 1 run) in {os.path.abspath(path)}. "
          f"For real figures: offload-engine bench io --path DIR --size 2GiB --runs 3",
          flush=True)
    cfg = bench_io.BenchConfig(path=path, size=args.size, runs=1)
    result = bench_io.run_benchmark(cfg, progress=bench_io._progress(args))
    print()
    print(bench_io.format_table(result))
    return 0
