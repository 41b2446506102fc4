"""ZeroMuon against torch.optim.Muon + torch.optim.AdamW on the unsharded model: bitwise.

Real processes (gloo, FSDP2 fully_shard) at world sizes 1-4; every case runs at least 3
steps and compares every parameter and every state tensor (momentum_buffer, exp_avg,
exp_avg_sq, step) bit for bit, with the store's home tier nvme (small buckets, a pinned
budget smaller than the state, so buckets are evicted and re-read) and cpu. One spawn per
world size runs all cases (process start-up dominates the time).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from offload_engine.optim import ZeroMuon, default_use_muon, split_state_dict
from helpers.zero_muon_harness import (MIXED_SHAPES, assert_parity, make_pair, reference_optimizers,
                               set_grads, spawn)
from helpers.zero_muon_cases import CASES, MLP, step_and_zero, store_config


def run_case(rank, world, mesh, case_no, tmp):
    muon_kw, adamw_kw, kind, extra = CASES[case_no]
    model, ref = make_pair(MIXED_SHAPES, mesh, seed=case_no)
    path = os.path.join(tmp, f"case{case_no}")
    opt = ZeroMuon(model.named_parameters(), **muon_kw, adamw=adamw_kw, store=store_config(kind, path))
    ref_opts = reference_optimizers(ref, muon_kw, adamw_kw)
    scheds = []
    if extra.get("scheduler"):
        lam = lambda s: 1.0 / (1 + s)
        scheds = [torch.optim.lr_scheduler.LambdaLR(o, lam) for o in [opt, *ref_opts]]
    try:
        for step in range(4):
            set_grads(model, ref, step + 10 * case_no, rank, world)
            if "clip" in extra:
                total = torch.nn.utils.clip_grad_norm_(model.parameters(), extra["clip"])
                total = total.full_tensor() if hasattr(total, "full_tensor") else total
                assert torch.allclose(total, torch.nn.utils.get_total_norm(
                    [q.grad for q in ref.parameters()]), rtol=1e-5)
                torch.nn.utils.clip_grads_with_norm_(ref.parameters(), extra["clip"], total)
            step_and_zero(opt, ref_opts, scheds)
            assert all(p.grad is None for p in model.parameters())
            assert_parity(opt, model, ref, ref_opts, rank, world, f"W={world} case {case_no} step {step}")
        st = opt.last_step_stats
        assert not opt._order_warned    # the walk followed the store's (alternating) order
        n_muon = sum(1 for n, p in ref.named_parameters() if default_use_muon(n, p))
        assert st.muon_params == n_muon
        if kind.startswith("nvme"):
            assert opt.store.stats().evictions or st.store_bytes_read["nvme"] or world > 1
    finally:
        opt.close()


def run_training(rank, world, mesh, tmp):
    """The real flow: FSDP2 forward/backward, 2 accumulation micro-steps, clip, scheduler."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    fully_shard(model.up, mesh=mesh)
    fully_shard(model.down, mesh=mesh)
    fully_shard(model, mesh=mesh)
    muon_kw, adamw_kw = dict(lr=0.02, weight_decay=0.1), dict(lr=3e-3, weight_decay=0.01)
    opt = ZeroMuon(model.named_parameters(), **muon_kw, adamw=adamw_kw,
                   store=store_config("nvme_evict", os.path.join(tmp, "train")))
    ref_opts = reference_optimizers(ref, muon_kw, adamw_kw)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in [opt, *ref_opts]]
    gen = torch.Generator().manual_seed(100 + rank)
    try:
        for step in range(3):
            for micro in range(2):
                tokens = torch.randint(0, 13, (4, 5), generator=gen)
                model(tokens).float().pow(2).mean().backward()
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).full_tensor()
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                q.grad = p.grad.full_tensor()   # already clipped: the reference sees the same
            step_and_zero(opt, ref_opts, scheds)
            assert total > 0.05  # clipping was active
            assert_parity(opt, model, ref, ref_opts, rank, world, f"training W={world} step {step}")
    finally:
        opt.close()


def parity_worker(rank, world, mesh, tmp):
    for case_no in range(len(CASES)):
        run_case(rank, world, mesh, case_no, tmp)
    run_training(rank, world, mesh, tmp)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_bitwise_parity_with_torch_muon_and_adamw(world, tmp_path):
    spawn(world, parity_worker, str(tmp_path))


# -- one process, plain tensors -------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["nvme_evict", "cpu"])
def test_plain_tensors_in_one_process(kind, tmp_path):
    shapes = dict(MIXED_SHAPES, scale=())   # a 0-d parameter too
    for case_no in range(len(CASES)):
        muon_kw, adamw_kw, _, extra = CASES[case_no]
        model, ref = make_pair(shapes, None, seed=case_no)
        with ZeroMuon(model.named_parameters(), **muon_kw, adamw=adamw_kw,
                      store=store_config(kind, str(tmp_path / f"{kind}{case_no}"))) as opt:
            ref_opts = reference_optimizers(ref, muon_kw, adamw_kw)
            for step in range(3):
                set_grads(model, ref, step, 0, 1)
                opt.step()
                for o in ref_opts:
                    o.step()
                assert_parity(opt, model, ref, ref_opts, 0, 1, f"plain {kind} case {case_no} step {step}")


def test_state_dict_round_trip_and_torch_muon_loads_it(tmp_path):
    """W=1: our state dict loads into torch.optim.Muon/AdamW, theirs into ours; both continue
    bit for bit."""
    muon_kw, adamw_kw = dict(lr=0.02, weight_decay=0.1), dict(lr=1e-3)
    model, ref = make_pair(MIXED_SHAPES, None)
    cfg = store_config("nvme_evict", str(tmp_path / "a"))
    with ZeroMuon(model.named_parameters(), **muon_kw, adamw=adamw_kw, store=cfg) as opt:
        for step in range(2):
            set_grads(model, ref, step, 0, 1)
            opt.step()
        sd = opt.state_dict()
    # torch continues from our state
    ref.load_state_dict(model.state_dict())
    ref_opts = reference_optimizers(ref, muon_kw, adamw_kw)
    for o, part in zip(ref_opts, split_state_dict(sd)):
        o.load_state_dict(part)
    # a fresh ZeroMuon (new store directory) continues from our state too
    model2, _ = make_pair(MIXED_SHAPES, None)
    model2.load_state_dict(model.state_dict())
    with ZeroMuon(model2.named_parameters(), **muon_kw, adamw=adamw_kw,
                  store=store_config("cpu", "")) as opt2:
        opt2.load_state_dict(sd)
        for step in range(2, 4):
            set_grads(model2, ref, step, 0, 1)
            opt2.step()
            for o in ref_opts:
                o.step()
            assert_parity(opt2, model2, ref, ref_opts, 0, 1, f"after load, step {step}")
        # and a torch state dict loads into ours
        model3, _ = make_pair(MIXED_SHAPES, None)
        model3.load_state_dict(ref.state_dict())
        with ZeroMuon(model3.named_parameters(), **muon_kw, adamw=adamw_kw) as opt3:
            muon_sd, adamw_sd = (o.state_dict() for o in ref_opts)
            shift = len(muon_sd["param_groups"][0]["params"])
            adamw_group = dict(adamw_sd["param_groups"][0])
            adamw_group["params"] = [i + shift for i in adamw_group["params"]]
            merged = {"state": {**muon_sd["state"],
                                **{k + shift: v for k, v in adamw_sd["state"].items()}},
                      "param_groups": [muon_sd["param_groups"][0], adamw_group]}
            opt3.load_state_dict(merged)
            set_grads(model3, ref, 9, 0, 1)
            opt3.step()
            for o in ref_opts:
                o.step()
            assert_parity(opt3, model3, ref, ref_opts, 0, 1, "torch state dict loaded")
