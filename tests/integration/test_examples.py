"""The scripts in examples/ run as the docs say: real torchrun subprocesses."""

import os
import re
import subprocess
import sys

import pytest

from helpers.paths import ROOT

EXAMPLE = os.path.join(ROOT, "examples", "train_fsdp2.py")


@pytest.mark.multiprocess
def test_train_fsdp2_under_torchrun_streams_state_and_the_loss_falls(tmp_path):
    store = tmp_path / "state"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           EXAMPLE, "--store", str(store)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = re.findall(r"step +(\d+)  loss ([0-9.]+)  nvme read (\d+) B  written (\d+) B", proc.stdout)
    assert len(rows) >= 3, proc.stdout
    losses = [float(r[1]) for r in rows]
    assert losses[-1] < 0.25 * losses[0], losses
    assert int(rows[-1][2]) > 0 and int(rows[-1][3]) > 0, "the state should stream from NVMe"
    for r in range(2):   # one store per rank, each with its arrays on disk
        assert (store / f"rank{r}" / "muon_momentum" / "zarr.json").exists()  # one level


def test_the_optimizer_doc_shows_the_example_verbatim():
    with open(EXAMPLE) as f:
        script = f.read()
    with open(os.path.join(ROOT, "docs", "optimizer.md")) as f:
        doc = f.read()
    assert f"```python\n{script}```" in doc
