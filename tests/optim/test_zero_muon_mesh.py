"""ZeroMuon on 2-D meshes and tensor-parallel placements against torch.optim.Muon + AdamW on
the unsharded model: bitwise, every parameter and every state tensor, every step.

Real processes (gloo, CPU): HSDP 2x2 (``fully_shard`` over a (replicate, shard) mesh),
FSDP + tensor parallel 2x2 (ColwiseParallel and RowwiseParallel matrices, a
SequenceParallel norm, modules without a plan on the dp sub-mesh) and tensor parallel
alone on a 1-D mesh of 3 (``Shard(0)``, ``Shard(1)`` and ``Replicate()`` side by side).
Shapes are odd (rows fewer than ranks, ``[1, N]``, columns not divisible by tp). Each mesh
runs three option sets with the state on NVMe (evicted and re-read) and in memory, then
a real forward/backward training run. One spawn per mesh (start-up dominates the time).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from offload_engine.optim import ZeroMuon, default_use_muon
from helpers.zero_muon_cases import CASES, MLP, step_and_zero, store_config
from helpers.zero_muon_harness import (assert_parity, local_part, reference_optimizers, set_grads,
                                spawn, spawn_mesh)
from helpers.zero_muon_meshes import fsdp_tp, hsdp, placements, tp

pytestmark = pytest.mark.multiprocess


def run_cases(rank, world, mesh, tmp, build, cases, expect):
    """Cases of test_zero_muon_parity on ``build(mesh)``'s model, 4 steps each."""
    for case_no in cases:
        muon_kw, adamw_kw, kind, extra = CASES[case_no]
        model, ref = build(mesh, seed=case_no)
        have = {n: str(pl) for n, pl in placements(model).items()}
        assert {n: have[n] for n in expect} == expect
        opt = ZeroMuon(model.named_parameters(), **muon_kw, adamw=adamw_kw,
                       store=store_config(kind, os.path.join(tmp, f"case{case_no}")))
        ref_opts = reference_optimizers(ref, muon_kw, adamw_kw)
        scheds = []
        if extra.get("scheduler"):
            scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s))
                      for o in [opt, *ref_opts]]
        try:
            for step in range(4):
                set_grads(model, ref, step + 10 * case_no, rank, world)
                if "clip" in extra:
                    total = torch.nn.utils.clip_grad_norm_(model.parameters(), extra["clip"])
                    total = total.full_tensor() if hasattr(total, "full_tensor") else total
                    torch.nn.utils.clip_grads_with_norm_(ref.parameters(), extra["clip"], total)
                step_and_zero(opt, ref_opts, scheds)
                assert_parity(opt, model, ref, ref_opts, rank, world,
                              f"{build.__name__} case {case_no} step {step}")
            assert not opt._order_warned
            st = opt.last_step_stats
            assert st.muon_params == sum(1 for n, p in ref.named_parameters() if default_use_muon(n, p))
        finally:
            opt.close()


# -- HSDP ---------------------------------------------------------------------------------------------
def hsdp_training(rank, world, mesh, tmp):
    """FSDP2 HSDP forward/backward (gradients averaged over all 4 ranks), 2 micro-steps,
    clipping, a scheduler; the reference steps on the same (full) gradients."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    for m in (model.up, model.down, model):
        fully_shard(m, mesh=mesh)
    muon_kw, adamw_kw = dict(lr=0.02, weight_decay=0.1), dict(lr=3e-3, weight_decay=0.01)
    opt = ZeroMuon(model.named_parameters(), **muon_kw, adamw=adamw_kw,
                   store=store_config("nvme_evict", os.path.join(tmp, "train")))
    ref_opts = reference_optimizers(ref, muon_kw, adamw_kw)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in [opt, *ref_opts]]
    gen = torch.Generator().manual_seed(100 + rank)
    try:
        for step in range(3):
            for micro in range(2):
                model(torch.randint(0, 13, (4, 5), generator=gen)).float().pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                q.grad = p.grad.full_tensor()
            step_and_zero(opt, ref_opts, scheds)
            assert_parity(opt, model, ref, ref_opts, rank, world, f"HSDP training step {step}")
    finally:
        opt.close()


def mesh_refusals(mesh):
    """Parameters on two meshes, neither inside the other, are refused: the exchange runs over
    one process group."""
    from torch.distributed.tensor import Shard, distribute_tensor
    a = nn.Parameter(distribute_tensor(torch.ones(4, 3), mesh["replicate"], (Shard(0),)))
    b = nn.Parameter(distribute_tensor(torch.ones(4, 3), mesh["shard"], (Shard(0),)))
    with pytest.raises(ValueError, match="all must be on one mesh or on sub-meshes of the largest"):
        ZeroMuon([("a", a), ("b", b)])


def hsdp_worker(rank, world, mesh, tmp):
    mesh_refusals(mesh)
    run_cases(rank, world, mesh, tmp, hsdp, range(len(CASES)),
              {"w_big": "(Replicate(), Shard(dim=0))"})
    hsdp_training(rank, world, mesh, tmp)
    # a 2-D mesh over part of the world (one pipeline stage of two): ZeroMuon exchanges over
    # the flattened mesh's own group
    from torch.distributed.device_mesh import init_device_mesh
    mesh3 = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))

    def stage(_, seed):
        return hsdp(mesh3["dp", "tp"], seed)
    stage.__name__ = "HSDP on a pipeline stage"
    run_cases(rank, world, None, os.path.join(tmp, f"stage{mesh3.get_local_rank('pp')}"), stage,
              (0,), {"w_big": "(Replicate(), Shard(dim=0))"})


def test_hsdp_2x2_bitwise_parity(tmp_path):
    spawn_mesh((2, 2), ("replicate", "shard"), hsdp_worker, str(tmp_path))


# -- FSDP + tensor parallel ----------------------------------------------------------------------------
class TPBlock(nn.Module):
    """embed -> up (colwise) -> relu -> down (rowwise) -> + -> norm -> head: a real
    tensor-parallel MLP; the embedding, norm and head have no plan (dp sub-mesh)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.up = nn.Linear(8, 12)
        self.down = nn.Linear(12, 8, bias=False)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 16, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.down(torch.relu(self.up(h)))
        return self.lm_head(self.norm(h))


def fsdp_tp_training(rank, world, mesh, tmp):
    """Forward/backward through ColwiseParallel/RowwiseParallel and FSDP2; the tp ranks of
    one dp index see the same batch, as in tensor-parallel training."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    torch.manual_seed(0)
    model = TPBlock()
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    have = {n: str(pl) for n, pl in placements(model).items()}
    assert have["up.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert have["down.weight"] == "(Shard(dim=0), Shard(dim=1))"
    muon_kw, adamw_kw = dict(lr=0.02, weight_decay=0.1), dict(lr=3e-3, weight_decay=0.01)
    opt = ZeroMuon(model.named_parameters(), **muon_kw, adamw=adamw_kw,
                   store=store_config("nvme_evict", os.path.join(tmp, "train")))
    ref_opts = reference_optimizers(ref, muon_kw, adamw_kw)
    gen = torch.Generator().manual_seed(100 + mesh.get_local_rank("dp"))
    try:
        for step in range(3):
            model(torch.randint(0, 16, (4, 5), generator=gen)).float().pow(2).mean().backward()
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                q.grad = p.grad.full_tensor()
            step_and_zero(opt, ref_opts, [])
            assert_parity(opt, model, ref, ref_opts, rank, world, f"FSDP+TP training step {step}")
    finally:
        opt.close()


def fsdp_tp_master_weights(rank, world, mesh, tmp):
    """bf16 parameters with fp32 masters on boxes: every master equals an fp32 torch run on
    the upcast gradients, and every parameter that result rounded to bf16, bit for bit."""
    model, ref = fsdp_tp(mesh, dtype=torch.bfloat16)
    muon_kw, adamw_kw = dict(lr=0.02, weight_decay=0.1), dict(lr=3e-3, weight_decay=0.01)
    cfg = {"nvme_paths": [os.path.join(tmp, "masters")], "bucket_bytes": 4096,
           "cpu_budget": 32 * 4096}
    ref_params = dict(ref.named_parameters())
    with ZeroMuon(model.named_parameters(), **muon_kw, adamw=adamw_kw, master_weights=True,
                  store=cfg) as opt:
        ref_opts = reference_optimizers(ref, muon_kw, adamw_kw)
        for step in range(3):
            set_grads(model, ref, step, rank, world)
            for name, p in model.named_parameters():
                ref_params[name].grad = p.grad.full_tensor().float()
            step_and_zero(opt, ref_opts, [])
            sd = opt.state_dict()
            for info in opt.infos:
                p = info.param
                want = local_part(ref_params[info.name].detach(), p)
                master = sd["state"][info.index]["master_param"]
                assert tuple(master.placements) == tuple(p.placements), info.name
                assert torch.equal(master.to_local(), want), f"step {step}: master of {info.name}"
                assert torch.equal(p.to_local(), want.bfloat16()), f"step {step}: {info.name}"


def state_dict_round_trip(rank, world, mesh, tmp, build):
    """Our state dict (DTensors with the parameters' placements) and torch's (full tensors)
    both load into a fresh ZeroMuon on the same mesh, which then continues bit for bit."""
    muon_kw, adamw_kw = dict(lr=0.02, weight_decay=0.1), dict(lr=1e-3)
    model, ref = build(mesh)
    ref_opts = reference_optimizers(ref, muon_kw, adamw_kw)
    with ZeroMuon(model.named_parameters(), **muon_kw, adamw=adamw_kw) as opt:
        for step in range(2):
            set_grads(model, ref, step, rank, world)
            step_and_zero(opt, ref_opts, [])
        ours = opt.state_dict()
    muon_sd, adamw_sd = (o.state_dict() for o in ref_opts)
    shift = len(muon_sd["param_groups"][0]["params"])
    adamw_group = dict(adamw_sd["param_groups"][0], params=[
        i + shift for i in adamw_sd["param_groups"][0]["params"]])
    theirs = {"state": {**muon_sd["state"], **{k + shift: v for k, v in adamw_sd["state"].items()}},
              "param_groups": [muon_sd["param_groups"][0], adamw_group]}
    copies = []
    for sd in (ours, theirs):
        m, _ = build(mesh)
        with torch.no_grad():
            for p, q in zip(m.parameters(), model.parameters()):
                p.to_local().copy_(q.to_local() if hasattr(q, "to_local") else q)
        o = ZeroMuon(m.named_parameters(), **muon_kw, adamw=adamw_kw)
        o.load_state_dict(sd)
        copies.append((m, o))
    for step in range(2, 4):
        for m, o in copies:
            set_grads(m, ref, step, rank, world)
            o.step()
        for o in ref_opts:
            o.step()
        for (m, o), what in zip(copies, ("ours", "torch's")):
            assert_parity(o, m, ref, ref_opts, rank, world, f"{what} state dict loaded, step {step}")
    for _, o in copies:
        o.close()


def fsdp_tp_worker(rank, world, mesh, tmp):
    run_cases(rank, world, mesh, tmp, fsdp_tp, (0, 1, 2), {
        "up.weight": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",     # colwise
        "down.weight": "(Shard(dim=0), Shard(dim=1))",                 # rowwise
        "norm.weight": "(Shard(dim=0), Replicate())",                  # SequenceParallel
        "plain.weight": "(Shard(dim=0),)"})                            # no plan: dp sub-mesh
    fsdp_tp_training(rank, world, mesh, tmp)
    fsdp_tp_master_weights(rank, world, mesh, tmp)
    state_dict_round_trip(rank, world, mesh, tmp, fsdp_tp)


def test_fsdp_tp_2x2_bitwise_parity(tmp_path):
    spawn_mesh((2, 2), ("dp", "tp"), fsdp_tp_worker, str(tmp_path))


# -- tensor parallel alone on a 1-D mesh of 3 ----------------------------------------------------------
def refusals(mesh):
    """A Partial parameter, and a gradient split unlike its parameter, are refused by name."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    w = nn.Parameter(DTensor.from_local(torch.ones(2, 3), mesh, (Partial(),), run_check=False))
    with pytest.raises(ValueError, match=r"parameter w has placements \(Partial\(sum\),\): a Partial"):
        ZeroMuon([("w", w)])
    w = nn.Parameter(distribute_tensor(torch.ones(6, 3), mesh, (Shard(0),)))
    with ZeroMuon([("w", w)]) as opt:
        w.grad = distribute_tensor(torch.ones(6, 3), mesh, (Replicate(),))
        with pytest.raises(ValueError, match=r"parameter w: the gradient is \(Replicate\(\),\) on "
                                             r"a 3 mesh, the parameter \(Shard\(dim=0\),\)"):
            opt.step()


def tp_worker(rank, world, mesh, tmp):
    refusals(mesh)
    run_cases(rank, world, mesh, tmp, tp, (0, 1, 2), {
        "up.weight": "(Shard(dim=0),)", "down.weight": "(Shard(dim=1),)",
        "plain.weight": "(Replicate(),)", "norm.weight": "(Replicate(),)",
        "embed_tokens.weight": "(Shard(dim=1),)"})


def test_tp_on_a_1d_mesh_of_3_with_mixed_placements_bitwise_parity(tmp_path):
    spawn(3, tp_worker, str(tmp_path))
