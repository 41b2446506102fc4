"""Memory of consolidate and inspect stays flat in the number of tensors, not only in bytes.

A mixture-of-experts DeepSpeed ZeRO-3 checkpoint holds 50,000-100,000 small per-expert
tensors. What a user relies on: consolidating or listing one costs a bounded amount of
memory per tensor. Each command runs as its own process (as a user runs it) on checkpoints
of 2,000 and 20,000 tensors of 256 elements (W=2, made by tools/make_deepspeed_checkpoint.py),
and its peak RSS (the kernel's, from ``os.wait4``) may grow by at most
``MAX_BYTES_PER_TENSOR`` per added tensor. Before the reader kept its metadata in compact
arrays, this growth was about 10 KB per tensor for consolidate and 8 KB for inspect (a
Python object per tensor, state and rank, every placeholder tensor of the model files, a
request object per tensor in flight per 64 MiB window); it is now 2-3 KB.
"""

from __future__ import annotations

import pytest

from helpers.peak_rss import assert_flat_in_tensors, cli_peak_rss, make_many_tensors

SMALL, LARGE = 2_000, 20_000
ELEMS = 256
MAX_BYTES_PER_TENSOR = 4096  # generous: measured 2.1-2.8 KB, before the fix 7.8-10.3 KB


@pytest.mark.multiprocess
def test_consolidate_and_inspect_memory_flat_in_tensor_count(tmp_path):
    peaks: dict[str, dict[int, int]] = {"consolidate": {}, "inspect": {}}
    for n in (SMALL, LARGE):
        ds = str(tmp_path / f"ds{n}")
        make_many_tensors(ds, n, ELEMS)
        peaks["consolidate"][n] = cli_peak_rss(["consolidate", ds, str(tmp_path / f"out{n}")])
        peaks["inspect"][n] = cli_peak_rss(["inspect", ds])
    for command, by_size in peaks.items():
        assert_flat_in_tensors(by_size, MAX_BYTES_PER_TENSOR, command)
