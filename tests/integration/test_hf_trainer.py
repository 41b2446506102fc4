"""The Hugging Face Trainer recipe (TrainerZeroMuon): trains with the Trainer's learning
rate, groups and schedule, saves, and resumes bit for bit, alone and under torchrun DDP."""

import os
import subprocess
import sys

import pytest
import torch

from helpers.paths import child_env, script

RUN = script("hf_trainer_run.py")

pytest.importorskip("accelerate", reason="the Trainer needs accelerate (a test dependency)")


def run(args, world: int = 1, port: int = 0):
    cmd = [sys.executable, RUN, *args]
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
               "--master-port", str(port), RUN, *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env=child_env({**os.environ, "OMP_NUM_THREADS": "1"}))
    assert done.returncode == 0, done.stderr[-3000:]


def results(folder, world):
    return [torch.load(os.path.join(folder, f"result-rank{r}.pt")) for r in range(world)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2])
def test_trainer_trains_saves_and_resumes_bit_for_bit(tmp_path, world):
    port = 29600 + os.getpid() % 200 * 2
    run([str(tmp_path / "whole"), "6"], world, port)
    run([str(tmp_path / "resumed"), "6", str(tmp_path / "whole" / "checkpoint-3")], world, port + 1)
    whole, resumed = results(tmp_path / "whole", world), results(tmp_path / "resumed", world)
    for a, b in zip(whole, resumed):
        assert a["losses"] == b["losses"] and len(a["losses"]) == 6
        for name, p in a["params"].items():
            assert torch.equal(p, b["params"][name]), name
    first = whole[0]
    assert first["muon"] and all(".h." in n for n in first["muon"])  # hidden matrices only
    assert not any(k in n for n in first["muon"] for k in ("wte", "wpe", "lm_head"))
    for other in whole[1:]:  # DDP ranks agree
        assert all(torch.equal(p, other["params"][n]) for n, p in first["params"].items())
