"""Saving after a forward with no backward (an evaluation between steps) under FSDP2
(issue 29 follow-up): FSDP2's root module keeps its own parameters (here the embedding,
final norm and head) unsharded after such a forward, registered as plain tensors in place
of its DTensors. ``save_checkpoint`` saw them as frozen parameters held whole by rank 0
(``rows_per_rank [64, 0]``), and a load at another world size failed ("rank 1 holds 32
rows, the tensor table says 0"). Likewise a load after an evaluation filled the shards while
the next forward used the stale whole copies. W=2 gloo: train a step, evaluate, save;
evaluate, load at W=1 and W=3: every parameter, and the next forward, bit for bit."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from offload_engine.checkpoint import load_checkpoint, save_checkpoint
from helpers.zero_muon_harness import local_part, spawn

VOCAB, DIM = 64, 16


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h).tanh()
        return self.head(self.norm(h))


def build(seed: int, mesh):
    from torch.distributed.fsdp import fully_shard
    from offload_engine.optim import ZeroMuon
    torch.manual_seed(seed)
    model = Net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = ZeroMuon(model.named_parameters(), lr=0.02, adamw={"lr": 3e-3},
                   store={"nvme_paths": [os.path.join(os.environ["EVAL_TMP"], f"state-{seed}-"
                                                      f"{mesh.size()}-{mesh.get_local_rank()}")],
                          "cpu_budget": "256KiB", "bucket_bytes": "16KiB"})
    return model, opt


def full(t):
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def train_evaluate_save(rank, world, mesh, tmp):
    from torch.distributed.tensor import DTensor
    os.environ["EVAL_TMP"] = tmp
    model, opt = build(0, mesh)
    x = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        model(x)  # evaluation: no backward
    assert not isinstance(model.embed.weight, DTensor)  # the trap: the root stays unsharded
    save_checkpoint(os.path.join(tmp, "ck"), model, opt, 1)
    want = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(want, os.path.join(tmp, "want.pt"))
    model(x).square().mean().backward()  # training goes on after the save
    opt.step()
    opt.close()


def load_and_compare(rank, world, mesh, tmp):
    os.environ["EVAL_TMP"] = tmp
    model, opt = build(7, mesh)
    with torch.no_grad():  # an evaluation before the load: the load fills the shards
        model(torch.randint(0, VOCAB, (2, 8)))
    assert load_checkpoint(os.path.join(tmp, "ck"), model, opt) == 1
    want = torch.load(os.path.join(tmp, "want.pt"))
    for name, p in model.named_parameters():
        assert torch.equal(p.to_local(), local_part(want[name], p)), (rank, world, name)
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # and the next forward computes with what was loaded
        got = model(x)
        plain = Net()
        plain.load_state_dict(want)
        assert torch.equal(got, plain(x)), (rank, world)
    opt.close()


@pytest.mark.multiprocess
def test_a_save_after_an_evaluation_loads_at_other_world_sizes(tmp_path):
    tmp = str(tmp_path)
    spawn(2, train_evaluate_save, tmp)
    spawn(1, load_and_compare, tmp)
    spawn(3, load_and_compare, tmp)
