"""The Hugging Face Trainer with ZeroMuon under ``accelerate launch`` with an FSDP2 config
(fsdp_version 2), 2 CPU processes (gloo).

accelerate 1.16 does not shard on CPU: ``AcceleratorState`` sets ``DistributedType.FSDP``
only when the process group is one of the accelerator kinds (MULTI_GPU, MULTI_NPU, ...),
and a CPU run is MULTI_CPU (accelerate/state.py). So the model is sharded with FSDP2 before
the Trainer sees it: by transformers at load time (``from_pretrained(...,
distributed_config=DistributedConfig(fsdp_size=2))``), or by hand (``fully_shard``). Then
``ZeroMuonTrainer`` trains the DTensor shards, saves our checkpoint into each Trainer
checkpoint folder, resumes from it bit for bit, and ``offload-engine consolidate`` of that
folder gives safetensors that ``from_pretrained`` loads with the trained weights. The plain
Trainer recipe runs as data parallel (the first test pins that, so a future accelerate that
does shard on CPU makes it fail and this file gets accelerate's own FSDP2 path).
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
from offload_engine.cli.main import main as cli_main  # noqa: E402

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


def launch(folder, args, port):
    """``accelerate launch --config_file CFG RUN args`` as a real process (gloo, CPU)."""
    config = folder / f"accelerate-{port}.yaml"
    config.write_text(FSDP2_CONFIG.format(world=WORLD, port=port))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
           RUN, *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=child_env({**os.environ, "OMP_NUM_THREADS": "1"}))
    assert done.returncode == 0, done.stderr[-3000:]


def results(folder):
    return [torch.load(os.path.join(folder, f"result-rank{r}.pt")) for r in range(WORLD)]


def base_port():
    return 29400 + os.getpid() % 100 * 4


def consolidated(checkpoint, out):
    """``offload-engine consolidate checkpoint out``, loaded with ``from_pretrained``."""
    assert cli_main(["consolidate", str(checkpoint), str(out)]) == 0
    return transformers.GPT2LMHeadModel.from_pretrained(out).eval()


def assert_same_weights(model, params):
    for name, p in model.named_parameters():
        assert torch.equal(p, params[name]), name


def assert_same_weights_dict(a, b):
    assert a.keys() == b.keys()
    for name, p in a.items():
        assert torch.equal(p, b[name]), name


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory):
    """An uninterrupted 6-step FSDP2 run (checkpoints at steps 3 and 6) and one resumed from
    its checkpoint-3."""
    tmp = tmp_path_factory.mktemp("accelerate")
    launch(tmp, [tmp / "whole", 6, "--fsdp2"], base_port())
    launch(tmp, [tmp / "resumed", 6, "--fsdp2", "--resume", tmp / "whole" / "checkpoint-3"],
           base_port() + 1)
    return tmp, results(tmp / "whole"), results(tmp / "resumed")


@pytest.mark.multiprocess
def test_accelerate_runs_the_fsdp2_config_as_multi_cpu_and_the_model_sharded_before(fsdp2_runs):
    _, whole, _ = fsdp2_runs
    for r in whole:
        assert r["world"] == WORLD and r["optimizer"] == "ZeroMuon"
        assert r["distributed_type"] == "MULTI_CPU" and not r["fsdp"]  # accelerate: no FSDP
        assert r["dtensor"]  # transformers' FSDP2 shards, which ZeroMuon trains


@pytest.mark.multiprocess
def test_fsdp2_trainer_resumes_from_its_checkpoint_bit_for_bit(fsdp2_runs):
    tmp, whole, resumed = fsdp2_runs
    for a, b in zip(whole, resumed):
        assert len(a["losses"]) == 6 and a["losses"] == b["losses"]
        assert_same_weights_dict(a["params"], b["params"])
        assert torch.equal(a["logits"], b["logits"])
    assert whole[0]["losses"] == whole[1]["losses"]  # one global loss, logged on both ranks
    assert_same_weights_dict(whole[0]["params"], whole[1]["params"])  # the gathered weights
    torch.manual_seed(0)  # the runner's initial weights: every parameter was stepped
    start = transformers.GPT2LMHeadModel(tiny_config())
    assert not any(torch.equal(p, whole[0]["params"][n]) for n, p in start.named_parameters())
    # the Trainer's folder is one of ours: generation step-3 named by 'latest'
    assert (tmp / "whole" / "checkpoint-3" / "latest").read_text().strip() == "step-00000003"


@pytest.mark.multiprocess
def test_fsdp2_checkpoint_consolidates_into_weights_from_pretrained_loads(fsdp2_runs):
    tmp, whole, _ = fsdp2_runs
    model = consolidated(tmp / "whole" / "checkpoint-6", tmp / "merged")
    assert_same_weights(model, whole[0]["params"])
    with torch.no_grad():
        assert torch.equal(model(probe_batch()).logits, whole[0]["logits"])


@pytest.mark.multiprocess
def test_fsdp2_by_hand_saves_a_checkpoint_that_consolidates(tmp_path):
    """``fully_shard`` by hand, the model marked as sharded at load time: the Trainer's
    save (its model weights gathered, ours sharded) and consolidate work the same."""
    launch(tmp_path, [tmp_path / "run", 3, "--fsdp2-by-hand"], base_port() + 2)
    ranks = results(tmp_path / "run")
    assert all(r["dtensor"] and len(r["losses"]) == 3 for r in ranks)
    assert_same_weights(consolidated(tmp_path / "run" / "checkpoint-3", tmp_path / "merged"),
                        ranks[0]["params"])
    saved = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "run" / "checkpoint-3")
    assert_same_weights(saved, ranks[0]["params"])  # the Trainer's model.safetensors


@pytest.mark.multiprocess
def test_plain_trainer_recipe_runs_as_data_parallel(tmp_path):
    """The Trainer recipe unchanged (``TrainerZeroMuon``, no sharding): accelerate wraps the
    model in DDP; the Trainer's own checkpoint loads with ``from_pretrained``. (Its resume is
    tested under torchrun DDP in test_hf_trainer.py.)"""
    launch(tmp_path, [tmp_path / "run", 3], base_port() + 3)
    ranks = results(tmp_path / "run")
    for r in ranks:
        assert r["distributed_type"] == "MULTI_CPU" and not r["fsdp"] and not r["dtensor"]
        assert r["optimizer"] == "ZeroMuon" and len(r["losses"]) == 3
    assert_same_weights_dict(ranks[0]["params"], ranks[1]["params"])  # DDP ranks agree
    saved = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "run" / "checkpoint-3")
    with torch.no_grad():
        assert torch.equal(saved.eval()(probe_batch()).logits, ranks[0]["logits"])
