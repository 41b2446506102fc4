"""Complete training checkpoints in one process: extra stateful objects and RNG states
(resumed runs equal uninterrupted ones bit for bit), tags, keep_last, model-only and
optimizer-only loads, refusals (other optimizers, state that cannot be stored safely, bad
tags), frozen parameters, tied names and buffers in consolidate, and a version 3
checkpoint from before all this still loading."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from offload_engine.checkpoint import (CheckpointError, ChecksumError, load_checkpoint, resolve,
                                       save_checkpoint)
from offload_engine.cli.main import main as cli_main
from offload_engine.consolidate import get_fp32_state_dict
from offload_engine.optim import ZeroMuon
from helpers.paths import FIXTURES

V3 = os.path.join(FIXTURES, "ours_v3")


class Net(nn.Module):
    """Tied embedding and head, a frozen block, BatchNorm statistics, dropout."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.body = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight
        self.drop = nn.Dropout(0.3)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        h = self.drop(self.body(self.emb(x).mean(1)))
        return self.head(self.bn(self.frozen(h)))


class Sampler:
    """A shuffling sampler with state: its own generator and a position (per rank)."""

    def __init__(self, n=50, seed=0):
        self.n, self.gen, self.pos = n, torch.Generator().manual_seed(seed), 0
        self.order = torch.randperm(n, generator=self.gen)

    def next(self, k):
        if self.pos + k > self.n:
            self.order, self.pos = torch.randperm(self.n, generator=self.gen), 0
        out = self.order[self.pos:self.pos + k]
        self.pos += k
        return out

    def state_dict(self):
        return {"pos": self.pos, "order": self.order, "gen": self.gen.get_state()}

    def load_state_dict(self, sd):
        self.pos, self.order = sd["pos"], sd["order"]
        self.gen.set_state(sd["gen"])


def store(path):
    return {"nvme_paths": [path], "cpu_budget": "64KiB", "bucket_bytes": "8KiB"}


def make(tmp, name, seed=0):
    torch.manual_seed(seed)
    model = Net()
    opt = ZeroMuon([(n, p) for n, p in model.named_parameters() if p.requires_grad], lr=0.02,
                   adamw={"lr": 3e-3}, store=store(os.path.join(tmp, name)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched, Sampler()


def train(model, opt, sched, sampler, steps):
    """Losses, with every RNG in use: dropout (torch), Python and numpy noise."""
    out = []
    for _ in range(steps):
        idx = sampler.next(4)
        x = (idx.view(4, 1) + torch.arange(5)) % 20
        noise = random.random() + float(np.random.rand())
        loss = model(x).logsumexp(-1).mean() * (1 + 1e-3 * noise)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        out.append(loss.item())
    return out


def trained_checkpoint(tmp):
    """A run of 2 steps saved at step 2 to ``tmp/ck``: (model, its open optimizer, ck)."""
    model, opt, sched, sampler = make(tmp, "a")
    train(model, opt, sched, sampler, 2)
    ck = os.path.join(tmp, "ck")
    save_checkpoint(ck, model, opt, 2)
    return model, opt, ck


def test_resume_with_scheduler_sampler_user_dict_and_rng_is_bitwise(tmp_path):
    tmp = str(tmp_path)
    model, opt, sched, sampler = make(tmp, "a")
    train(model, opt, sched, sampler, 3)
    user = {"epoch": 3, "best": float("inf"), "__tuple__": "not a marker", (1, 2): (3, None)}
    save_checkpoint(os.path.join(tmp, "ck"), model, opt, 3,
                    extra={"scheduler": sched, "sampler": sampler, "user": user})
    want = train(model, opt, sched, sampler, 5)
    opt.close()

    model, opt, sched, sampler = make(tmp, "b", seed=7)
    random.seed(99)
    np.random.seed(99)
    got_user = {"stale": True}
    step = load_checkpoint(os.path.join(tmp, "ck"), model, opt,
                           extra={"scheduler": sched, "sampler": sampler, "user": got_user})
    assert step == 3 and got_user == user
    assert train(model, opt, sched, sampler, 5) == want
    opt.close()

    # without the scheduler, sampler and RNG the same resume differs: the test can fail
    model, opt, sched, sampler = make(tmp, "c", seed=7)
    load_checkpoint(os.path.join(tmp, "ck"), model, opt, rng=False)
    assert train(model, opt, sched, sampler, 5) != want
    opt.close()


def test_extra_state_that_cannot_be_stored_safely_is_refused(tmp_path):
    model, opt, sched, sampler = make(str(tmp_path), "a")
    ck = str(tmp_path / "ck")
    with pytest.raises(TypeError, match=r"extra\['user'\]\['fn'\]: a builtins.function cannot be stored"):
        save_checkpoint(ck, model, opt, 1, extra={"user": {"fn": lambda: 0}})
    with pytest.raises(TypeError, match=r"extra\['sampler'\]: a list has no state_dict"):
        save_checkpoint(ck, model, opt, 1, extra={"sampler": [1, 2]})
    with pytest.raises(TypeError, match="extra must be a dict"):
        save_checkpoint(ck, model, opt, 1, extra=[sched])
    with pytest.raises(TypeError, match=r"extra\['user'\]\['s'\]: a builtins.set"):
        save_checkpoint(ck, model, opt, 1, extra={"user": {"s": {1, 2}}})
    assert not os.path.exists(os.path.join(ck, "latest"))  # nothing was committed
    save_checkpoint(ck, model, opt, 1, extra={"scheduler": sched})
    with pytest.raises(CheckpointError, match=r"no saved state for extra\['sampler'\] \(saved: scheduler\)"):
        load_checkpoint(ck, model, opt, extra={"sampler": sampler})
    opt.close()


def test_training_state_is_json_and_checksummed(tmp_path):
    model, opt, sched, sampler = make(str(tmp_path), "a")
    ck = str(tmp_path / "ck")
    gen = save_checkpoint(ck, model, opt, 1, extra={"scheduler": sched})
    opt.close()
    path = os.path.join(gen, "rank0", "training_state", "zarr.json")
    doc = json.load(open(path))["attributes"]["training_state"]
    assert doc["extra"]["scheduler"]["last_epoch"] == 0 and set(doc["rng"]) >= {"python", "torch", "numpy"}
    raw = open(path, "rb").read()
    open(path, "wb").write(raw.replace(b'"last_epoch":0', b'"last_epoch":5'))
    model, opt, sched, _ = make(str(tmp_path), "b")
    with pytest.raises(ChecksumError, match="training_state"):
        load_checkpoint(ck, model, opt, extra={"scheduler": sched})
    opt.close()


def test_tags_name_generations_and_bad_tags_are_refused(tmp_path):
    model, opt, _, _ = make(str(tmp_path), "a")
    ck = str(tmp_path / "ck")
    for bad in ["../x", "a/b", "", "x.partial", "latest", ".hidden", "a..b", "s.deleting",
                "g.superseded-1", "x" * 200, "sp ace"]:
        with pytest.raises(ValueError, match="checkpoint tag"):
            save_checkpoint(ck, model, opt, 1, tag=bad)
    assert not os.path.exists(ck) or not os.listdir(ck)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert os.path.basename(save_checkpoint(ck, model, opt, 1, tag="epoch-1")) == "epoch-1"
    for p in model.parameters():
        p.grad = torch.ones_like(p) if p.requires_grad else None
    opt.step()
    save_checkpoint(ck, model, opt, 2)
    assert open(os.path.join(ck, "latest")).read().strip() == "step-00000002"
    opt.close()
    model, opt, _, _ = make(str(tmp_path), "b", seed=3)
    assert load_checkpoint(ck, model, opt, tag="epoch-1") == 1
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())
    opt.close()


def test_keep_last_keeps_the_newest_and_what_latest_names(tmp_path):
    model, opt, _, _ = make(str(tmp_path), "a")
    ck = str(tmp_path / "ck")
    for s in range(1, 6):
        save_checkpoint(ck, model, opt, s, keep_last=2)
    assert sorted(os.listdir(ck)) == [".writer-lock", "latest", "step-00000004", "step-00000005"]
    with open(os.path.join(ck, "latest"), "w") as f:  # roll back by hand to step 4
        f.write("step-00000004\n")
    save_checkpoint(ck, model, opt, 3, keep_last=1)  # the newest by step is 5, latest is 3
    assert sorted(os.listdir(ck)) == [".writer-lock", "latest", "step-00000003", "step-00000005"]
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(ck, model, opt, 9, keep_last=0)
    opt.close()


def test_optimizer_only_and_model_only_loads(tmp_path):
    tmp = str(tmp_path)
    model, opt, ck = trained_checkpoint(tmp)
    state = opt.state_dict()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    opt.close()

    other, opt2, _, _ = make(tmp, "b", seed=5)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    assert load_checkpoint(ck, None, opt2) == 2  # optimizer only: weights untouched
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
    got = opt2.state_dict()
    for i, entry in state["state"].items():
        for k, v in entry.items():
            assert torch.equal(got["state"][i][k], v), (i, k)
    opt2.close()

    torch.manual_seed(11)
    plain = Net()  # model only: weights, frozen weights, tied head, buffers
    assert load_checkpoint(ck, plain) == 2
    for k, v in plain.state_dict().items():
        assert torch.equal(v, weights[k]), k
    assert plain.head.weight is plain.emb.weight
    bigger = Net()
    bigger.more = nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match="has no parameter 'more.weight'"):
        load_checkpoint(ck, bigger)
    part = nn.Module()
    part.emb, part.other = nn.Embedding(20, 8), nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match="strict=False"):
        load_checkpoint(ck, part)
    load_checkpoint(ck, part, strict=False)
    assert torch.equal(part.emb.weight, weights["emb.weight"])


def test_other_optimizers_get_a_type_error_naming_zero_muon(tmp_path):
    model = Net()
    adam = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match=r"save_checkpoint: the optimizer must be an offload_engine.optim.ZeroMuon.*torch.optim.adamw.AdamW"):
        save_checkpoint(str(tmp_path / "ck"), model, adam, 1)
    with pytest.raises(TypeError, match=r"load_checkpoint: the optimizer must be .*ZeroMuon"):
        load_checkpoint(str(tmp_path / "ck"), model, adam)
    assert not (tmp_path / "ck").exists()


def test_consolidate_writes_frozen_tied_and_buffers_once(tmp_path):
    tmp = str(tmp_path)
    model, opt, ck = trained_checkpoint(tmp)
    opt.close()
    want = model.state_dict()
    out = os.path.join(tmp, "hf")
    assert cli_main(["consolidate", ck, out, "--verify"]) == 0
    got = load_file(os.path.join(out, "model.safetensors"))
    assert "head.weight" not in got  # written once, under its owner, with the alias recorded
    assert set(got) | {"head.weight"} == set(want)
    assert all(torch.equal(got[k], want[k]) for k in got)
    from safetensors import safe_open
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert f.metadata().get("head.weight") == "emb.weight"
    sd = get_fp32_state_dict(ck)
    assert set(sd) == set(want) and sd["head.weight"] is sd["emb.weight"]
    lean = get_fp32_state_dict(ck, exclude_frozen=True)  # buffers stay, as in DeepSpeed
    assert set(lean) == set(want) - {"frozen.weight", "frozen.bias"}
    out2 = os.path.join(tmp, "hf2")
    assert cli_main(["consolidate", ck, out2, "--exclude-frozen"]) == 0
    assert set(load_file(os.path.join(out2, "model.safetensors"))) == set(got) - {"frozen.weight", "frozen.bias"}


def test_a_version_3_checkpoint_from_before_still_loads(tmp_path):
    want = load_file(os.path.join(V3, "expected_state_dict.safetensors"))
    ck = os.path.join(V3, "ck")
    assert json.load(open(os.path.join(resolve(ck), "zarr.json")))["attributes"]["format_version"] == 3

    def fresh():
        torch.manual_seed(5)
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    model = fresh()
    opt = ZeroMuon(model.named_parameters(), lr=0.02, adamw={"lr": 1e-3}, store=store(str(tmp_path / "s")))
    assert load_checkpoint(ck, model, opt) == 2  # a resume: no training state, no RNG
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    opt.close()
    model = fresh()
    assert load_checkpoint(ck, model) == 2
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    with pytest.raises(CheckpointError, match="saved without training state"):
        load_checkpoint(ck, model, extra={"user": {}})
    sd = get_fp32_state_dict(ck)
    assert all(torch.equal(sd[k], want[k]) for k in want)


def test_safe_state_round_trips_every_allowed_type_and_refuses_forged_values():
    from offload_engine.checkpoint.safe_state import decode, encode
    value = {"i": 2**70, "f": -0.0, "nan": float("nan"), "s": "x", "n": None, "b": True,
             "l": [1, (2, 3)], "t": torch.arange(6, dtype=torch.bfloat16).view(2, 3),
             "e": torch.empty(0, 4), "a": np.arange(3, dtype=np.uint32), "g": np.float64(2.5),
             "__dict__": {1: "int key", (2, "x"): [], None: 0}}
    doc = json.loads(json.dumps(encode(value, "v"), allow_nan=False))  # strict JSON
    back = decode(doc, "v")
    assert back["i"] == 2**70 and str(back["f"]) == "-0.0" and back["nan"] != back["nan"]
    assert back["l"] == [1, (2, 3)] and back["__dict__"] == value["__dict__"]
    assert back["t"].dtype == torch.bfloat16 and torch.equal(back["t"], value["t"])
    assert back["e"].shape == (0, 4) and back["a"].dtype == np.uint32
    assert isinstance(back["g"], np.float64) and back["g"] == 2.5
    for forged, why in [({"__tensor__": {"dtype": "uint8", "shape": [4], "data": "AAA="}}, "needs 4 bytes"),
                        ({"__tensor__": {"dtype": "object", "shape": [], "data": ""}}, "unknown tensor dtype"),
                        ({"__ndarray__": {"dtype": "O", "shape": [1], "data": ""}}, "not a number type"),
                        ({"__float__": "1e999"}, "must be nan, inf or -inf"),
                        ({"__tensor__": {"dtype": "uint8", "shape": [-1], "data": ""}}, "shape must be"),
                        ({"__dict__": [[[1], 2]]}, "cannot be a dict key")]:
        with pytest.raises(ValueError, match=why):
            decode(forged, "v")
