"""Loading a mixture-of-experts checkpoint into a model whose expert stack holds another
number of experts is refused in one line naming the parameter, and changes nothing."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from offload_engine.checkpoint import load_checkpoint, save_checkpoint
from offload_engine.formats.errors import CheckpointError
from offload_engine.optim import ZeroMuon

from helpers.checkpoint_runs import store


def moe(experts: int) -> nn.Module:
    model = nn.Module()
    model.moe = nn.Module()
    model.moe.experts = nn.Module()
    model.moe.experts.w1 = nn.Parameter(torch.randn(experts, 4, 3))
    model.norm = nn.Parameter(torch.randn(3))
    return model


def test_a_stack_of_other_expert_count_is_refused(tmp_path):
    saved = moe(5)
    with ZeroMuon(saved.named_parameters(), lr=0.02, store=store(str(tmp_path / "s1"))) as opt:
        for p in saved.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        save_checkpoint(str(tmp_path / "ck"), saved, opt, step=1)
    model = moe(4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with ZeroMuon(model.named_parameters(), lr=0.02, store=store(str(tmp_path / "s2"))) as opt:
        with pytest.raises(CheckpointError) as err:
            load_checkpoint(str(tmp_path / "ck"), model, opt)
    msg = str(err.value)
    assert "\n" not in msg and "moe.experts.w1" in msg and "[5, 4, 3]" in msg and "[4, 4, 3]" in msg
    assert os.path.basename(str(tmp_path / "ck")) in msg
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
