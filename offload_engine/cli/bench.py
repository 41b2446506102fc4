"""`offload-engine bench`: measurements that size a run. One subcommand per benchmark.

- ``bench io``: disk throughput of the engine against fio, zarr-python and tensorstore
  (see ``bench_io``).
- ``bench disk``: sweep the engine's I/O settings on one disk and cache the best for
  ``plan`` (see ``bench_disk``).
"""

from __future__ import annotations

from . import bench_disk, bench_io


def add_parser(subparsers):
    p = subparsers.add_parser(
        "bench", help="measure throughput (bench io, bench disk)",
        description="Measurements that size a run, one subcommand per benchmark.")
    sub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    bench_io.add_parser(sub)
    bench_disk.add_parser(sub)
    return p
