"""Parameters passed without names (model.parameters(), the group dicts the Hugging Face
Trainer and torchtitan build): with model=, embeddings and output heads stay on AdamW by
module whatever their names; without it, a warning says the split was guessed."""

import warnings

import pytest
import torch
from torch import nn

from offload_engine.optim import ZeroMuon


class Tiny(nn.Module):
    """Names the name rule cannot read: an embedding called 'tok', a head called
    'decoder.proj' that the model declares as its output embeddings."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(40, 16)
        self.body = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.decoder = nn.Module()
        self.decoder.proj = nn.Linear(16, 40, bias=False)

    def get_output_embeddings(self):
        return self.decoder.proj


def kinds(opt) -> dict:
    out = {}
    for g in opt.param_groups:
        for name, p in zip(g.get("param_names") or [None] * len(g["params"]), g["params"]):
            out[name] = "muon" if g["use_muon"] else "adamw"
    return out


STORE = {"default_home": "cpu", "bucket_bytes": 4096, "cpu_budget": 256 * 4096}


def test_unnamed_parameters_are_named_and_classified_by_module():
    model = Tiny()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is guessed: no warning
        opt = ZeroMuon(model.parameters(), model=model, store=STORE)
    assert kinds(opt) == {"tok.weight": "adamw", "body.weight": "muon", "body.bias": "adamw",
                          "norm.weight": "adamw", "norm.bias": "adamw",
                          "decoder.proj.weight": "adamw"}
    opt.close()


def test_trainer_style_groups_keep_their_options():
    model = Tiny()
    decay = [model.tok.weight, model.body.weight, model.decoder.proj.weight]
    no_decay = [model.body.bias, model.norm.weight, model.norm.bias]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    with ZeroMuon(groups, lr=0.02, model=model, store=STORE) as opt:
        by_name = {}
        for g in opt.param_groups:
            for n in g["param_names"]:
                by_name[n] = (g["use_muon"], g["weight_decay"])
    assert by_name == {"body.weight": (True, 0.1), "tok.weight": (False, 0.1),
                       "decoder.proj.weight": (False, 0.1), "body.bias": (False, 0.0),
                       "norm.weight": (False, 0.0), "norm.bias": (False, 0.0)}


def test_named_parameters_still_meet_the_module_check():
    model = Tiny()
    with ZeroMuon(model.named_parameters(), model=model, store=STORE) as opt:
        assert kinds(opt)["tok.weight"] == "adamw"  # 'tok' says nothing; the module does
        assert kinds(opt)["decoder.proj.weight"] == "adamw"


def test_without_the_model_the_guess_is_announced():
    model = Tiny()
    with pytest.warns(UserWarning, match=r"3 2-D parameter\(s\) without names"):
        opt = ZeroMuon(model.parameters(), store=STORE)
    muon = [tuple(p.shape) for g in opt.param_groups if g["use_muon"] for p in g["params"]]
    assert sorted(muon) == [(16, 16), (40, 16), (40, 16)]  # the embedding and head on Muon
    opt.close()


def test_a_tensor_the_model_does_not_hold_is_refused():
    model = Tiny()
    stray = nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"shape \[3, 3\].*not a parameter of the model"):
        ZeroMuon([*model.parameters(), stray], model=model, store=STORE)


def test_parameters_swapped_after_construction_are_refused():
    """accelerate's FSDP2 preparation replaces an existing optimizer's parameters with the
    sharded ones; ZeroMuon's state was laid out for the originals: the step says so instead
    of updating tensors the model no longer uses."""
    model = Tiny()
    with ZeroMuon(model.named_parameters(), model=model, store=STORE) as opt:
        replacement = nn.Parameter(model.body.weight.detach().clone())
        group = next(g for g in opt.param_groups if g["use_muon"])
        group["params"][0] = replacement
        replacement.grad = torch.ones_like(replacement)
        with pytest.raises(RuntimeError, match="other parameters than those it was built with"):
            opt.step()
