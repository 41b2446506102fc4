"""Memory of ``consolidate`` of OUR checkpoint format stays flat in the number of tensors.

A mixture-of-experts checkpoint holds 50,000-100,000 small per-expert tensors; what a user
relies on: consolidating one costs a bounded amount of memory per tensor. Our checkpoints
are made here as users make them from DeepSpeed (``import deepspeed`` of W=2 ZeRO-3
checkpoints of 2,000 and 20,000 tensors of 256 elements with AdamW moments, made by
tools/make_deepspeed_checkpoint.py); ``consolidate`` runs as its own process and its peak
RSS (the kernel's, from ``os.wait4``) may grow by at most ``MAX_BYTES_PER_TENSOR`` per added
tensor. Before, the reader parsed each rank's shard table whole (about 1.3 KB of JSON
objects per tensor) and kept a placement of every state, the Adam moments it never reads
included, each with its own copy of its array's name: 7.3-7.7 KB per tensor here. Most of
what is left per tensor is the manifest's tensor table (about 2 KB, as for ``inspect``).
"""

from __future__ import annotations

import pytest

from helpers.peak_rss import assert_flat_in_tensors, cli_peak_rss, make_many_tensors

SMALL, LARGE = 2_000, 20_000
ELEMS = 256
MAX_BYTES_PER_TENSOR = 6144  # measured 4.8 (fp32) and 4.5 KB (bf16); before: 7.3 and 7.7 KB


@pytest.mark.multiprocess
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_consolidate_of_ours_memory_flat_in_tensor_count(tmp_path, dtype):
    peaks = {}
    for n in (SMALL, LARGE):
        ds, ck = str(tmp_path / f"ds{n}"), str(tmp_path / f"ck{n}")
        make_many_tensors(ds, n, ELEMS, dtype)
        cli_peak_rss(["import", "deepspeed", ds, ck, "--world-size", "2"])
        peaks[n] = cli_peak_rss(["consolidate", ck, str(tmp_path / f"out{n}")])
    assert_flat_in_tensors(peaks, MAX_BYTES_PER_TENSOR, f"consolidate of our format ({dtype})")
