"""`offload-engine bench`: measurements that size a run. One subcommand per benchmark.

- ``bench io``: disk throughput of the engine against fio, zarr-python and tensorstore
  (see ``bench_io``).
"""

from __future__ import annotations

from . import bench_io


def add_parser(subparsers):
    p = subparsers.add_parser(
        "bench", help="measure throughput (bench io)",
        description="Measurements that size a run, one subcommand per benchmark.")
    sub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    bench_io.add_parser(sub)
    return p
