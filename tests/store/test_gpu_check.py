"""tools/gpu_check.sh runs anywhere: on a machine without CUDA its CPU half runs (ZeroMuon
against torch.optim.Muon/AdamW bit for bit, the step with state on disk and in memory) and
the CUDA sections say they were skipped, in one JSON object."""

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers.paths import ROOT



@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the script's own job")
def test_gpu_check_runs_its_cpu_half(tmp_path):
    done = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh"),
                           str(tmp_path / "check.json")],
                          env={**os.environ, "PYTHON": sys.executable, "GPU_CHECK_DIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["machine"]["cuda"] is False
    assert report["parity"]["bitwise"] is True and report["parity"]["device"] == "cpu"
    assert set(report["step"]["homes"]) == {"nvme", "cpu"}
    assert all(h["step_s"] > 0 for h in report["step"]["homes"].values())
    assert report["copies"]["skipped"] == report["gpu_tier"]["skipped"] == "no CUDA"
    assert not [p for p in os.listdir(tmp_path) if p.startswith("gpu-check-")]  # cleaned up
