"""Checkpoints of an expert-parallel run reshard to other meshes, bit for bit.

Real processes (gloo, CPU). A torchtitan-style MoE block (grouped experts ``w1 [5, 8, 6]``,
``w2 [5, 6, 8]``, ``w3 [5, 8, 6]``, a router, norms, embedding and head) trains 3 steps
under expert parallelism EP=2: each stack ``distribute_tensor(w, ep_mesh, [Shard(0)])``
(3 + 2 experts, each orthogonalized by Muon where it is), the dense parameters FSDP2-sharded
over the same ranks (``ignored_params``: the experts keep their EP placement). It saves;
the checkpoint loads under FSDP2 at W=3 (stacks split 2 + 2 + 1 on the expert dimension),
which saves again, and that one loads at W=1: every parameter and optimizer state equals
the EP run's, bit for bit, at every load. The EP checkpoint loads at W=1 directly too,
exports one expert's momentum (``--expert 4``) and consolidates one tensor per expert.

The same with EP x FSDP on a 2x2 mesh (dp, ep): each stack ``(Shard(1), Shard(0))`` (its
experts over ep, each expert's rows over dp: a box per rank in the checkpoint), the dense
parameters HSDP ``(Replicate(), Shard(0))``.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
from torch import nn

from offload_engine.checkpoint import load_checkpoint, save_checkpoint
from offload_engine.cli.main import main
from offload_engine.optim import ZeroMuon

from helpers.checkpoint_runs import store
from helpers.consolidate_outputs import load_output
from helpers.moe_models import assert_same_state, full_state
from helpers.zero_muon_harness import set_grads, spawn, spawn_mesh

pytestmark = pytest.mark.multiprocess

STEPS, EXPERTS = 3, 5
OPTIONS = dict(lr=0.02, weight_decay=0.1, adamw=dict(lr=3e-3, weight_decay=0.01))


class Experts(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, 8, 6, generator=g))
        self.w2 = nn.Parameter(torch.randn(EXPERTS, 6, 8, generator=g))
        self.w3 = nn.Parameter(torch.randn(EXPERTS, 8, 6, generator=g))


class MoEBlock(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.experts = Experts(g)
        self.router = nn.Module()
        self.router.weight = nn.Parameter(torch.randn(EXPERTS, 6, generator=g))


class MoEBag(nn.Module):
    """Parameters only (gradients are set directly): the names and shapes of a torchtitan
    MoE layer between an embedding and a head."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed_tokens = nn.Parameter(torch.randn(11, 6, generator=g))
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].moe = MoEBlock(g)
        self.layers[0].norm = nn.Parameter(torch.randn(6, generator=g))
        self.lm_head = nn.Parameter(torch.randn(11, 6, generator=g))


def expert_parallel(mesh, seed: int):
    """(model, twin): the stacks EP-sharded on ``mesh`` (1-D: Shard(0); 2-D (dp, ep):
    (Shard(1), Shard(0))), the rest FSDP2 (HSDP on the 2-D mesh)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    model = MoEBag(seed)
    twin = copy.deepcopy(model)
    experts = model.layers[0].moe.experts
    placements = [Shard(0)] if mesh.ndim == 1 else [Shard(1), Shard(0)]
    for name, p in list(experts.named_parameters()):
        experts.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), mesh, placements)))
    fully_shard(model, mesh=mesh, ignored_params=set(experts.parameters()))
    return model, twin


def fsdp(mesh, seed: int):
    from torch.distributed.fsdp import fully_shard
    model = MoEBag(seed)
    fully_shard(model, mesh=mesh)
    return model


def train_ep(rank, world, mesh, tmp):
    model, twin = expert_parallel(mesh, seed=3)
    w1 = model.layers[0].moe.experts.w1
    # experts 3 + 2 over ep; on 2x2 each expert's 8 rows 4 + 4 over dp too
    assert tuple(w1.to_local().shape[:2]) == ((3, 8), (2, 8))[rank] if world == 2 else \
        ((3, 4), (2, 4), (3, 4), (2, 4))[rank]
    with ZeroMuon(model.named_parameters(), **OPTIONS,
                  store=store(os.path.join(tmp, "store_ep"))) as opt:
        assert {i.name: i.kind for i in opt.infos}["layers.0.moe.experts.w1"] == "muon"
        for step in range(STEPS):
            set_grads(model, twin, step, rank, world)
            opt.step()
            opt.zero_grad()
        state = full_state(model, opt)
        save_checkpoint(os.path.join(tmp, "ckpt_ep"), model, opt, step=STEPS)
    if rank == 0:
        torch.save(state, os.path.join(tmp, "trained.pt"))


def reshard_w3(rank, world, mesh, tmp):
    model = fsdp(mesh, seed=4)   # other values until loaded
    assert model.layers[0].moe.experts.w2.to_local().shape[0] == (2, 2, 1)[rank]
    with ZeroMuon(model.named_parameters(), **OPTIONS,
                  store=store(os.path.join(tmp, "store_w3"))) as opt:
        assert load_checkpoint(os.path.join(tmp, "ckpt_ep"), model, opt) == STEPS
        assert_same_state(full_state(model, opt), torch.load(os.path.join(tmp, "trained.pt")),
                          f"FSDP W=3 from the EP run, rank {rank}")
        save_checkpoint(os.path.join(tmp, "ckpt_w3"), model, opt, step=STEPS)


@pytest.mark.parametrize("ep_mesh", ["ep2", "ep2xdp2"])
def test_expert_parallel_checkpoint_reshards_to_fsdp_w3_then_w1_bitwise(tmp_path, ep_mesh):
    tmp = str(tmp_path)
    if ep_mesh == "ep2":
        spawn(2, train_ep, tmp)
    else:
        spawn_mesh((2, 2), ("dp", "ep"), train_ep, tmp)
    spawn(3, reshard_w3, tmp)
    trained = torch.load(os.path.join(tmp, "trained.pt"))
    for ckpt in ("ckpt_w3", "ckpt_ep"):
        model = MoEBag(seed=5)
        with ZeroMuon(model.named_parameters(), **OPTIONS,
                      store=store(os.path.join(tmp, f"store_w1_{ckpt}"))) as opt:
            assert load_checkpoint(os.path.join(tmp, ckpt), model, opt) == STEPS
            assert_same_state(full_state(model, opt), trained, f"W=1 from {ckpt}")

    # one expert, read from the EP run's shards (boxes on 2x2), and the per-expert consolidation
    w1 = "layers.0.moe.experts.w1"
    out = os.path.join(tmp, "e4.npy")
    assert main(["export", os.path.join(tmp, "ckpt_ep"), w1, "--expert", "4", "--state",
                 "momentum_buffer", "--out", out]) == 0
    assert torch.equal(torch.from_numpy(np.load(out)), trained[(w1, "momentum_buffer")][4])
    hf = os.path.join(tmp, "hf")
    assert main(["consolidate", os.path.join(tmp, "ckpt_ep"), hf, "--experts", "per-expert",
                 "--verify"]) == 0
    written, _ = load_output(hf)
    for e in range(EXPERTS):
        for w in ("w1", "w2", "w3"):
            assert torch.equal(written[f"layers.0.moe.experts.{e}.{w}.weight"],
                               trained[(f"layers.0.moe.experts.{w}", "param")][e])
