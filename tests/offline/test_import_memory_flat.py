"""Memory of ``import deepspeed`` stays flat in the number of tensors, not only in bytes.

A mixture-of-experts DeepSpeed ZeRO-3 checkpoint holds 50,000-100,000 small per-expert
tensors. What a user relies on: importing one costs a bounded amount of memory per tensor.
The import runs as its own process (as a user runs it) on checkpoints of 2,000 and 20,000
tensors of 256 elements (W=2 -> W=2, fp32 and bf16 models, made by
tools/make_deepspeed_checkpoint.py), and its peak RSS (the kernel's, from ``os.wait4``) may
grow by at most ``MAX_BYTES_PER_TENSOR`` per added tensor (most of what is left is the
DeepSpeed reader's metadata, as for consolidate). Before the import streamed its tables it
built every rank's shard table and the tensor table as JSON objects per tensor, and their
text whole, beside windows of a read request and a tensor view per tensor: 4.8-6.0 KB per
tensor.
"""

from __future__ import annotations

import pytest

from helpers.peak_rss import assert_flat_in_tensors, cli_peak_rss, make_many_tensors

SMALL, LARGE = 2_000, 20_000
ELEMS = 256
WINDOW = "1MiB"  # blocks of both sizes filled: what grows is per tensor, not the window
MAX_BYTES_PER_TENSOR = 3072  # measured 1.7 (fp32) and 1.9 KB (bf16); before: 4.8 and 6.0 KB


@pytest.mark.multiprocess
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_import_memory_flat_in_tensor_count(tmp_path, dtype):
    peaks = {}
    for n in (SMALL, LARGE):
        ds = str(tmp_path / f"ds{n}")
        make_many_tensors(ds, n, ELEMS, dtype)
        peaks[n] = cli_peak_rss(["import", "deepspeed", ds, str(tmp_path / f"ck{n}"),
                                 "--world-size", "2", "--window-size", WINDOW])
    assert_flat_in_tensors(peaks, MAX_BYTES_PER_TENSOR, f"import deepspeed ({dtype})")
