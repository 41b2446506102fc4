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


@pytest.mark.multiprocess
def test_expert_parallel_example_trains_and_its_checkpoint_consolidates_per_expert(tmp_path):
    """examples/train_moe_ep.py under torchrun (2 processes): whole experts per rank
    (Shard(0) on the expert dimension), tokens routed by all_to_all, every expert on Muon;
    the loss falls, and the expert-parallel checkpoint consolidates on one process into one
    tensor per expert."""
    from safetensors import safe_open
    example = os.path.join(ROOT, "examples", "train_moe_ep.py")
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           example, "--store", str(tmp_path / "state"), "--checkpoint", str(ckpt), "--steps", "21"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = re.findall(r"step +(\d+)  loss ([0-9.]+)  all_to_all \(Muon\) (\d+) B", proc.stdout)
    losses = [float(r[1]) for r in rows]
    assert len(losses) == 3 and losses[-1] < 0.5 * losses[0], proc.stdout
    cli = [sys.executable, "-m", "offload_engine.cli.main"]
    proc = subprocess.run(cli + ["consolidate", str(ckpt), str(out), "--experts", "per-expert"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    for layer in range(2):
        for w in ("w1", "w2", "w3"):
            assert not any(n.endswith(f"layers.{layer}.moe.experts.{w}") for n in names)
        assert sum(f".layers.{layer}.moe.experts." in f".{n}" for n in names) == 12, names
    proc = subprocess.run(cli + ["inspect", str(ckpt), "--json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert '"layers.0.moe.experts.w1"' in proc.stdout
