"""Consolidating our own checkpoints: a run that kept fp32 masters is written as those
masters (what the run trained), not as the rounded bf16 parameters."""

import os

import pytest
import torch

from offload_engine.checkpoint import save_checkpoint
from offload_engine.cli.main import main
from offload_engine.consolidate import get_fp32_state_dict
from offload_engine.optim import ZeroMuon

from helpers.consolidate_outputs import load_output
from helpers.zero_muon_harness import MIXED_SHAPES, Bag, set_grads, spawn

KiB = 1024


def _train_bf16_with_masters(rank, world, mesh, tmp):
    import copy

    from torch.distributed.fsdp import fully_shard

    model = Bag(MIXED_SHAPES, seed=3).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    fully_shard(model, mesh=mesh)
    store = {"nvme_paths": [os.path.join(tmp, "state")], "bucket_bytes": 4 * KiB,
             "cpu_budget": 64 * KiB, "prefetch_depth": 1, "io_threads": 2}
    with ZeroMuon(model.named_parameters(), lr=0.02, master_weights=True, store=store) as opt:
        for step in range(3):
            set_grads(model, ref, step, rank, world)
            opt.step()
        save_checkpoint(os.path.join(tmp, "ck"), model, opt, step=3)
        names = {id(p): n for n, p in model.named_parameters()}
        order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
        state = opt.state_dict()["state"]
        masters = {order[i]: s["master_param"].full_tensor() for i, s in state.items()}
        params = {n: p.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"masters": masters, "params": params}, os.path.join(tmp, "truth.pt"))


@pytest.mark.multiprocess
def test_bf16_run_with_masters_consolidates_to_its_fp32_masters(tmp_path, capsys):
    spawn(2, _train_bf16_with_masters, str(tmp_path))
    truth = torch.load(tmp_path / "truth.pt")
    masters, params = truth["masters"], truth["params"]
    assert masters.keys() == params.keys() == set(MIXED_SHAPES)
    assert all(m.dtype == torch.float32 for m in masters.values())
    # the case must tell them apart: the masters are not the bf16 values widened
    assert any(not torch.equal(m, params[n].float()) for n, m in masters.items())

    assert main(["consolidate", str(tmp_path / "ck"), str(tmp_path / "hf"), "--verify"]) == 0
    written, _ = load_output(tmp_path / "hf")
    via_api = get_fp32_state_dict(str(tmp_path / "ck"))
    for name, master in masters.items():
        assert written[name].dtype == torch.float32
        assert torch.equal(written[name], master), name
        assert torch.equal(via_api[name], master), name
    # --dtype bf16 gives the parameters the run held (the masters rounded once)
    assert main(["consolidate", str(tmp_path / "ck"), str(tmp_path / "hf16"), "--dtype", "bf16"]) == 0
    rounded, _ = load_output(tmp_path / "hf16")
    for name, p in params.items():
        assert torch.equal(rounded[name], p), name
