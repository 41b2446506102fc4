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

import os
import subprocess
import sys

import pytest

from helpers.paths import ROOT

SMALL, LARGE = 2_000, 20_000
ELEMS = 256
MAX_BYTES_PER_TENSOR = 4096  # generous: measured 2.1-2.8 KB, before the fix 7.8-10.3 KB


def _make(out: str, tensors: int) -> None:
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_deepspeed_checkpoint.py"),
                    "--out", out, "--tensors", str(tensors), "--params", str(tensors * ELEMS),
                    "--world", "2"], check=True, capture_output=True, timeout=300)


def _peak_rss(args: list[str]) -> int:
    """Peak RSS (bytes) of ``offload-engine ARGS`` run as its own process; it must exit 0."""
    proc = subprocess.Popen([sys.executable, "-m", "offload_engine.cli.main", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": ROOT})
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, f"offload-engine {' '.join(args)}: {err.decode()[-2000:]}"
    return usage.ru_maxrss * 1024


@pytest.mark.multiprocess
def test_consolidate_and_inspect_memory_flat_in_tensor_count(tmp_path):
    peaks: dict[str, dict[int, int]] = {"consolidate": {}, "inspect": {}}
    for n in (SMALL, LARGE):
        ds = str(tmp_path / f"ds{n}")
        _make(ds, n)
        peaks["consolidate"][n] = _peak_rss(["consolidate", ds, str(tmp_path / f"out{n}")])
        peaks["inspect"][n] = _peak_rss(["inspect", ds])
    for command, by_size in peaks.items():
        per_tensor = (by_size[LARGE] - by_size[SMALL]) / (LARGE - SMALL)
        assert per_tensor < MAX_BYTES_PER_TENSOR, (
            f"{command}: peak RSS grew {per_tensor:.0f} bytes per tensor from {SMALL} to "
            f"{LARGE} tensors ({by_size[SMALL] >> 20} MiB -> {by_size[LARGE] >> 20} MiB)")
