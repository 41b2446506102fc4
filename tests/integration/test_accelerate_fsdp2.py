"""The Hugging Face Trainer with TrainerZeroMuon under ``accelerate launch`` with an FSDP2
config (fsdp_version 2), 2 CPU processes.

accelerate 1.16 does not shard on CPU: ``AcceleratorState`` sets ``DistributedType.FSDP``
only when the process group is one of the accelerator kinds (MULTI_GPU, MULTI_NPU, ...),
and a CPU run is MULTI_CPU (accelerate/state.py). So the FSDP2 config runs as data
parallel over gloo, whole parameters on each rank. The first test pins that, so a future
accelerate that does shard on CPU makes it fail and this file gets the FSDP2 assertions;
the second tests what runs: trains, saves, resumes bit for bit, and the saved model loads
with ``from_pretrained``; the third applies FSDP2 by hand inside the Trainer.
"""

import os
import subprocess
import sys

import pytest
import torch

from helpers.paths import child_env, script

pytest.importorskip("accelerate", reason="accelerate launch is the client under test")
transformers = pytest.importorskip("transformers")

from helpers.accelerate_trainer_run import probe_batch, tiny_config  # noqa: E402 (after the skips)

RUN = script("accelerate_trainer_run.py")
WORLD = 2

FSDP2_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_machines: 1
num_processes: {world}
machine_rank: 0
main_process_port: {port}
mixed_precision: 'no'
use_cpu: true
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: GPT2Block
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_reshard_after_forward: true
  fsdp_cpu_ram_efficient_loading: false
"""


def launch(config, args):
    """``accelerate launch --config_file config RUN args`` as a real process (gloo, CPU)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
           RUN, *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=child_env({**os.environ, "OMP_NUM_THREADS": "1"}))
    assert done.returncode == 0, done.stderr[-3000:]


def results(folder):
    return [torch.load(os.path.join(folder, f"result-rank{r}.pt")) for r in range(WORLD)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 6-step run and one resumed from its step-3 checkpoint."""
    tmp = tmp_path_factory.mktemp("accelerate")
    port = 29400 + os.getpid() % 200 * 2
    whole_cfg, resumed_cfg = tmp / "whole.yaml", tmp / "resumed.yaml"
    whole_cfg.write_text(FSDP2_CONFIG.format(world=WORLD, port=port))
    resumed_cfg.write_text(FSDP2_CONFIG.format(world=WORLD, port=port + 1))
    launch(whole_cfg, [tmp / "whole", 6])
    launch(resumed_cfg, [tmp / "resumed", 6, tmp / "whole" / "checkpoint-3"])
    return tmp, results(tmp / "whole"), results(tmp / "resumed")


@pytest.mark.multiprocess
def test_fsdp2_config_runs_as_data_parallel_on_cpu(runs):
    _, whole, _ = runs
    for r in whole:
        assert r["world"] == WORLD
        assert r["distributed_type"] == "MULTI_CPU" and not r["fsdp"] and not r["dtensor"]


@pytest.mark.multiprocess
def test_trains_saves_resumes_bit_for_bit_and_loads_with_from_pretrained(runs):
    tmp, whole, resumed = runs
    for a, b in zip(whole, resumed):
        assert len(a["losses"]) == 6 and a["losses"] == b["losses"]
        for name, p in a["params"].items():
            assert torch.equal(p, b["params"][name]), name
        assert torch.equal(a["logits"], b["logits"])
    for other in whole[1:]:  # data parallel: the ranks agree
        assert all(torch.equal(p, other["params"][n]) for n, p in whole[0]["params"].items())
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp / "whole" / "checkpoint-6").eval()
    with torch.no_grad():
        assert torch.equal(loaded(probe_batch()).logits, whole[0]["logits"])


@pytest.mark.multiprocess
def test_fsdp2_by_hand_inside_the_trainer_trains_with_zero_muon(tmp_path):
    """What a CPU user can do instead: fully_shard by hand, then the Trainer (no resume:
    the Trainer refuses to save optimizer state for a model sharded before it)."""
    config = tmp_path / "fsdp2.yaml"
    config.write_text(FSDP2_CONFIG.format(world=WORLD, port=29800 + os.getpid() % 100))
    launch(config, [tmp_path, 4, "--fsdp2-by-hand"])
    ranks = results(tmp_path)
    for r in ranks:
        assert r["dtensor"] and r["optimizer"] == "ZeroMuon" and len(r["losses"]) == 4
        assert all(torch.isfinite(torch.tensor(loss)) for _, loss in r["losses"])
    assert ranks[0]["losses"] == ranks[1]["losses"]  # one global loss, logged on both ranks
    for name, p in ranks[0]["params"].items():  # the gathered parameters agree
        assert torch.equal(p, ranks[1]["params"][name]), name
    torch.manual_seed(0)  # the runner's initial weights
    start = transformers.GPT2LMHeadModel(tiny_config())
    moved = [n for n, p in start.named_parameters() if not torch.equal(p, ranks[0]["params"][n])]
    assert len(moved) == len(ranks[0]["params"])  # every parameter was stepped
