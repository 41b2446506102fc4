"""The peak memory of a command as a user runs it, and the checkpoints that measure it."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers.paths import ROOT, child_env


def cli_peak_rss(args: list[str]) -> int:
    """Peak RSS (bytes, the kernel's ``ru_maxrss`` from ``os.wait4``) of ``offload-engine
    ARGS`` run as its own process; it must exit 0 (its stderr tail is the failure)."""
    proc = subprocess.Popen([sys.executable, "-m", "offload_engine.cli.main", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=child_env())
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, f"offload-engine {' '.join(args)}: {err.decode()[-2000:]}"
    return usage.ru_maxrss * 1024


def make_many_tensors(out: str, tensors: int, elems: int, dtype: str = "fp32") -> None:
    """A W=2 DeepSpeed ZeRO-3 checkpoint (AdamW moments) of ``tensors`` tensors of ``elems``
    elements at ``out`` (tools/make_deepspeed_checkpoint.py)."""
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_deepspeed_checkpoint.py"),
                    "--out", out, "--tensors", str(tensors), "--params", str(tensors * elems),
                    "--world", "2", "--dtype", dtype], check=True, capture_output=True,
                   timeout=300)


def assert_flat_in_tensors(peaks: dict[int, int], max_bytes_per_tensor: float, what: str) -> None:
    """Fail unless peak RSS (``peaks``: {tensor count: bytes}) grew by less than
    ``max_bytes_per_tensor`` per tensor added between the smallest and largest count."""
    small, large = min(peaks), max(peaks)
    per_tensor = (peaks[large] - peaks[small]) / (large - small)
    assert per_tensor < max_bytes_per_tensor, (
        f"{what}: peak RSS grew {per_tensor:.0f} bytes per tensor from {small} to {large} "
        f"tensors ({peaks[small] >> 20} MiB -> {peaks[large] >> 20} MiB)")
