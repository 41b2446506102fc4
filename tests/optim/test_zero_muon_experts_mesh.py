"""Expert weights across ranks (gloo, real processes): bitwise parity with torch.optim.Muon
on each expert slice as its own 2-D parameter + torch.optim.AdamW for the rest, every
parameter and state tensor after every step, and all_to_all bytes equal to the formulas of
docs/optimizer.md (Mixture of experts), on:

- FSDP2 W=3: stacks sharded on the expert dimension (whole experts per rank: no exchange)
  and on their rows (``Shard(1)``, torchtitan's choice when experts are fewer than ranks;
  a stack with 2 rows on 3 ranks); a top-2 router trained for real with grouped and
  per-expert ModuleList experts, some getting no tokens in a step;
- expert parallel EP=2 (``Shard(0)`` on the expert dimension, 5 experts on 2 ranks, dense
  layers FSDP-sharded over the same ranks);
- EP x FSDP 2x2: ``(Shard(1), Shard(0))`` (each expert's rows over dp, experts over ep),
  ``(Shard(0), Shard(0))``, 2 experts on 4 ranks; bf16 parameters with fp32 masters and the
  state on NVMe through a pool smaller than it;
- EP with tensor parallelism on the dense layers: dense parameters on the (dp, tp) mesh,
  experts on the ep (= tp) sub-mesh, replicated over dp;
- refused: per-expert Linear layers that differ between ep ranks, FSDP-sharded over dp (the
  same position would hold different experts).

Each check runs 3 steps; one process launch per mesh runs all its cases.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

from offload_engine.optim import ZeroMuon
from offload_engine.optim.owners import ns_flops
from helpers.zero_muon_accounting import expected_bytes, gathered_boxes, step_only_all_to_all
from helpers.zero_muon_experts import (MoE, ExpertBag, SliceReference, check_parity,
                                       distribute_, even_shapes, odd_shapes)
from helpers.zero_muon_harness import set_grads, spawn, spawn_mesh

pytestmark = pytest.mark.multiprocess
KiB = 4096
MUON_KW, ADAMW_KW = dict(lr=0.02, weight_decay=0.1), dict(lr=3e-3, weight_decay=0.01)


def run_steps(rank, world, model, ref, where, tmp, store_kind="cpu", masters=False,
              closed_form=None, only=None):
    """Three steps of ZeroMuon and the per-expert reference on gradients set directly:
    parity after each, all_to_all bytes as the boxes and owners say (and ``closed_form``
    when given), no other collective, Newton-Schulz shared out (at most a share plus one
    matrix per rank). Returns the optimizer's last step stats."""
    boxes = gathered_boxes(model)
    if store_kind == "cpu":
        cfg = {"default_home": "cpu", "bucket_bytes": KiB, "cpu_budget": 64 * KiB}
    else:   # the state goes through a pool smaller than it
        cfg = {"nvme_paths": [os.path.join(tmp, where)], "bucket_bytes": KiB,
               "cpu_budget": 10 * KiB, "prefetch_depth": 1}
    named = [(n, p) for n, p in model.named_parameters() if only is None or n in only]
    opt = ZeroMuon(named, **MUON_KW, adamw=ADAMW_KW, store=cfg, master_weights=masters)
    sref = SliceReference(ref, MUON_KW, ADAMW_KW)
    try:
        if store_kind != "cpu":
            assert opt.layout.state_bytes() > cfg["cpu_budget"], (where, opt.layout.state_bytes())
        for step in range(3):
            set_grads(model, ref, step, rank, world)
            if masters:   # the reference runs in fp32 on the gradients ZeroMuon upcasts
                for q in ref.parameters():
                    q.grad = q.grad.bfloat16().float()
            step_only_all_to_all(opt)
            sref.step()
            opt.zero_grad()
            sref.zero_grad()
            check_parity(opt, model, sref, f"{where} rank {rank} step {step}", masters=masters,
                         only=only)
            st = opt.last_step_stats
            assert (st.a2a_bytes_sent, st.a2a_bytes_received) == expected_bytes(opt, boxes, rank), where
            if closed_form is not None:
                assert st.a2a_bytes_sent == st.a2a_bytes_received == closed_form, (
                    where, st.a2a_bytes_sent, closed_form)
        check_ns_share(opt, where)
        if store_kind != "cpu":
            assert st.store_bytes_read["nvme"] > 0, where
        return st
    finally:
        opt.close()


def check_ns_share(opt, where: str) -> None:
    """Each matrix of a distributed parameter is orthogonalized by exactly one rank, and no
    rank does more than its share of the work plus one matrix, or, where the whole experts
    it holds are already more than its share (5 experts on 2 ranks), more than those plus
    one matrix."""
    muon = [c for c in opt.layout.bundles if c.kind == "muon" and c.distributed]
    mine = [[(m.param, m.expert, ns_flops(m.rows, m.cols)) for c in muon
             for m in getattr(opt.plans[c.index], kind)] for kind in ("owned", "kept")]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    done = [(p, e) for work in every for part in work for p, e, _ in part]
    assert len(done) == len(set(done)), f"{where}: a matrix orthogonalized twice"
    owned = [sum(f for *_, f in work[0]) for work in every]
    kept = [sum(f for *_, f in work[1]) for work in every]
    loads = [a + b for a, b in zip(owned, kept)]
    biggest = max(f for work in every for part in work for *_, f in part)
    share = sum(loads) / len(loads)
    for r, load in enumerate(loads):
        assert load <= max(share, kept[r]) + biggest, (where, r, owned, kept, biggest)


def bag_pair(experts: dict, dense: dict, dtype=torch.float32):
    model = ExpertBag(experts, dense).to(dtype)
    return model, copy.deepcopy(model).float()


# -- FSDP2, W=3 ------------------------------------------------------------------------------------
def fsdp_worker(rank, world, mesh, tmp):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    # 5 experts over 3 ranks by FSDP2's Shard(0): 2, 2, 1 whole experts each, kept where they are
    model, ref = bag_pair(*odd_shapes(5))
    fully_shard(model.dense, mesh=mesh)
    fully_shard(model.experts, mesh=mesh)
    run_steps(rank, world, model, ref, "fsdp_whole_experts", tmp)
    # Shard(1) (FSDP2 needs it even): every expert's 60 rows of w1 over the 3 ranks, each
    # expert to one owner among its holders; the other stacks Shard(0)
    model, ref = bag_pair(*odd_shapes(5, scale=10))
    fully_shard(model.dense, mesh=mesh)
    fully_shard(model.experts, mesh=mesh,
                shard_placement_fn=lambda p: Shard(1) if p.shape[1] % world == 0 else Shard(0))
    run_steps(rank, world, model, ref, "fsdp_expert_rows", tmp, store_kind="nvme")
    for grouped in (True, False):
        router_training(rank, world, mesh, grouped)


def router_training(rank, world, mesh, grouped: bool):
    """A top-2 token-choice router, 3 steps of real forward/backward under FSDP2 (every rank
    the same tokens, so that an expert without tokens has none anywhere): expert ``step % 4``
    gets no tokens (zeros in a stack, no gradient for a per-expert Linear, skipped as torch
    Muon skips it)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    model = MoE(grouped, experts=4)
    ref = copy.deepcopy(model)
    if not grouped:
        for e in model.experts:
            fully_shard(e, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = ZeroMuon(model.named_parameters(), **MUON_KW, adamw=ADAMW_KW)
    sref = SliceReference(ref, MUON_KW, ADAMW_KW)
    gen = torch.Generator().manual_seed(7)
    try:
        for step in range(3):
            tokens = torch.randint(0, 13, (2, 5), generator=gen)
            model.expert_bias.zero_()
            model.expert_bias[step % 4] = -1e4
            model(tokens).pow(2).mean().backward()
            for p, q in zip(model.parameters(), ref.parameters()):
                q.grad = None if p.grad is None else (
                    p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone())
            cold = (model.experts.w1.grad.full_tensor()[step % 4].any() if grouped
                    else model.experts[step % 4].w1.weight.grad is not None)
            assert not cold, "the cold expert got tokens"
            opt.step()
            sref.step()
            opt.zero_grad()
            sref.zero_grad()
            check_parity(opt, model, sref, f"router grouped={grouped} step {step}")
    finally:
        opt.close()


def test_experts_on_fsdp_w3_bitwise_parity(tmp_path):
    spawn(3, fsdp_worker, str(tmp_path))


# -- expert parallel, EP=2 ------------------------------------------------------------------------
def ep_worker(rank, world, mesh, tmp):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    # 5 experts on 2 ranks (3 and 2), the dense layers FSDP over the same ranks
    model, ref = bag_pair(*odd_shapes(5, scale=8))
    distribute_(model.experts, mesh, (Shard(0),))
    fully_shard(model.dense, mesh=mesh)
    st = run_steps(rank, world, model, ref, "ep2_odd", tmp, store_kind="nvme")
    # even: the experts move nothing; the dense matrices FSDP2's 4(W-1)/W * P_dense/W
    experts, dense = even_shapes(4)
    model, ref = bag_pair(experts, dense)
    distribute_(model.experts, mesh, (Shard(0),))
    fully_shard(model.dense, mesh=mesh)
    p_dense = sum(r * c for r, c in dense.values())
    st = run_steps(rank, world, model, ref, "ep2_even", tmp,
                   closed_form=4 * (world - 1) * p_dense // world // world)
    assert st.ns_calls == 2 * 4 // world + 4 // world   # its experts of each stack, 2 dense
    # per-expert Linear weights (Hugging Face 4.x, DeepSpeed): each rank gives the optimizer
    # its own 3 of 6 experts, plain tensors it orthogonalizes itself; dense layers FSDP
    model = ExpertBag({}, odd_shapes(6)[1])
    model.experts = torch.nn.ModuleList(ExpertBag({}, {"w1": (6, 8), "w2": (8, 6)}, seed=e).dense
                                        for e in range(6))   # experts.{e}.w1.weight
    ref = copy.deepcopy(model)
    fully_shard(model.dense, mesh=mesh)
    only = {n for n, _ in model.named_parameters()
            if not n.startswith("experts.") or int(n.split(".")[1]) // 3 == rank}
    st = run_steps(rank, world, model, ref, "ep2_list", tmp, only=only)
    assert st.ns_calls == 3 * 2 + 1, st.ns_calls        # its 6 expert matrices + 1 of 2 dense


def test_expert_parallel_ep2_bitwise_parity_and_bytes(tmp_path):
    spawn(2, ep_worker, str(tmp_path))


# -- 2 x 2: EP x FSDP, and EP with tensor parallel dense layers ------------------------------------
def mesh_worker(rank, world, mesh, tmp):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    flat = mesh._flatten("dp_ep")
    refuse_different_experts_at_one_position(rank, mesh, flat)
    # EP x FSDP: each expert's rows over dp, experts over ep; the dense layers FSDP over all
    for experts in (4, 2):      # 2 experts on 4 ranks: each expert on one ep rank, split over dp
        model, ref = bag_pair(*odd_shapes(experts))
        distribute_(model.experts, mesh, (Shard(1), Shard(0)))
        fully_shard(model.dense, mesh=flat)
        run_steps(rank, world, model, ref, f"ep_fsdp_{experts}", tmp)
    # (Shard(0), Shard(0)): 4 experts, one whole expert a rank; bf16 with fp32 masters on NVMe
    model, ref = bag_pair(*odd_shapes(4, scale=8), dtype=torch.bfloat16)
    distribute_(model.experts, mesh, (Shard(0), Shard(0)))
    fully_shard(model.dense, mesh=flat)
    run_steps(rank, world, model, ref, "ep_fsdp_masters", tmp, store_kind="nvme", masters=True)
    # even: experts 4(D-1)/D * P_experts/W with D = 2 ranks splitting each expert
    experts, dense = even_shapes(4)
    model, ref = bag_pair(experts, dense)
    distribute_(model.experts, mesh, (Shard(1), Shard(0)))
    fully_shard(model.dense, mesh=flat)
    p_dense = sum(r * c for r, c in dense.values())
    p_exp = sum(e * r * c for e, r, c in experts.values())
    run_steps(rank, world, model, ref, "ep_fsdp_even", tmp,
              closed_form=(4 * (world - 1) * p_dense // world // world
                           + 4 * (2 - 1) * p_exp // 2 // world))
    # EP with tensor parallel dense layers: dense on the (dp, tp) mesh, experts on the
    # ep = tp sub-mesh (each expert whole on one tp rank, replicated over dp)
    tp_dense = {"embed_tokens": (Shard(0), Shard(1)), "gate": (Shard(0), Replicate()),
                "w": (Shard(0), Shard(1)), "norm": (Replicate(), Replicate()),
                "lm_head": (Shard(0), Shard(0)), "w0": (Shard(0), Shard(1)),
                "w1": (Shard(0), Shard(0)), "w2": (Shard(0), Shard(1)), "w3": (Shard(0), Shard(1))}
    model, ref = bag_pair(*odd_shapes(5, scale=8))
    distribute_(model.experts, mesh["ep"], (Shard(0),))
    distribute_(model.dense, mesh, tp_dense)
    run_steps(rank, world, model, ref, "ep_tp", tmp, store_kind="nvme")
    # even: the dense matrices in W distinct boxes, 4(W-1)/W * P_dense/W; each expert's owner
    # is one of its 2 replicas and returns O to the other: 2(R-1)/R * P_experts/ep
    model, ref = bag_pair(experts, dense)
    distribute_(model.experts, mesh["ep"], (Shard(0),))
    distribute_(model.dense, mesh, tp_dense)
    run_steps(rank, world, model, ref, "ep_tp_even", tmp,
              closed_form=(4 * (world - 1) * p_dense // world // world
                           + 2 * (2 - 1) * p_exp // 2 // 2))


def refuse_different_experts_at_one_position(rank, mesh, flat):
    """Per-expert Linear layers, each ep rank its own 2 of 4, FSDP-sharded over dp: the same
    position holds another expert on the other ep rank, which is not one tensor's box.
    Refused by name at construction (taken for replicas, they would mix experts)."""
    from torch.distributed.fsdp import fully_shard
    model = ExpertBag({}, odd_shapes(4)[1])
    model.experts = torch.nn.ModuleList(ExpertBag({}, {"w1": (6, 8)}, seed=e).dense
                                        for e in range(4))
    ep = rank % 2
    for e in (2 * ep, 2 * ep + 1):
        fully_shard(model.experts[e], mesh=mesh["dp"])
    fully_shard(model.dense, mesh=flat)
    named = [(n, p) for n, p in model.named_parameters()
             if not n.startswith("experts.") or int(n.split(".")[1]) // 2 == ep]
    with pytest.raises(ValueError, match=r"DTensor parameter experts\.\d\.w1\.weight of rank "
                                         r"\d is another parameter on rank \d"):
        ZeroMuon(named)


def test_ep_x_fsdp_and_ep_with_tp_2x2_bitwise_parity_and_bytes(tmp_path):
    spawn_mesh((2, 2), ("dp", "ep"), mesh_worker, str(tmp_path))
