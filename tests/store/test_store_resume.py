"""A crashed run resumes into its old store directory (docs/checkpoint.md, "Resuming into
the old store directory"): killed with SIGKILL mid-training, its store left on disk holding
state newer than its last checkpoint; a new process opens the same directory with
``stale_store="discard"``, loads the checkpoint and trains on: bit for bit the run that was
never interrupted. Without the opt-in the directory is refused with a message that says
how to resume; a store another process has open is refused whatever the option."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from offload_engine.optim import ZeroMuon
from offload_engine.store import StoreLockedError

STEPS, CKPT_AT, KILL_AT = 6, 2, 4

WORKER = textwrap.dedent("""
    import os, sys, torch
    from torch import nn
    from offload_engine.optim import ZeroMuon
    from offload_engine.checkpoint import load_checkpoint, save_checkpoint

    mode, state, ck, out = sys.argv[1:5]
    STEPS, CKPT_AT, KILL_AT = {steps}, {ckpt_at}, {kill_at}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 12))
    store = {{"nvme_paths": [state], "bucket_bytes": 4096, "cpu_budget": 32 * 4096}}
    opt = ZeroMuon(model.named_parameters(), lr=0.02, store=store,
                   stale_store="discard" if mode == "resume" else "refuse")
    first = 1
    if mode == "resume":
        # nothing of the killed run's store is taken: the state starts at zero
        fresh = opt.state_dict()["state"]
        assert all(bool((v == 0).all()) for s in fresh.values() for k, v in s.items()
                   if k != "step"), "stale state read as current"
        first = load_checkpoint(ck, model, opt) + 1
    for step in range(first, STEPS + 1):
        g = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        if mode == "crash" and step == CKPT_AT:
            save_checkpoint(ck, model, opt, step=step)
        if mode == "crash" and step == KILL_AT:
            opt.store.flush(sync=True)   # the store on disk holds step KILL_AT's state
            print("ready", flush=True)
            sys.stdin.readline()         # killed here
    torch.save({{"params": {{n: p.detach().clone() for n, p in model.named_parameters()}},
                "state": opt.state_dict()["state"]}}, out)
    opt.close()
""").format(steps=STEPS, ckpt_at=CKPT_AT, kill_at=KILL_AT)


def _run(mode: str, state, ck, out, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WORKER, mode, str(state), str(ck), str(out)],
                          capture_output=True, text=True, timeout=300, **kw)


def _model_and_store(state):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 12))
    return model, {"nvme_paths": [str(state)], "bucket_bytes": 4096, "cpu_budget": 32 * 4096}


@pytest.mark.multiprocess
def test_a_run_killed_mid_training_resumes_into_its_old_store_directory_bitwise(tmp_path):
    state, ck = tmp_path / "state", tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-c", WORKER, "crash", str(state), str(ck),
                             str(tmp_path / "never.pt")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        model, store = _model_and_store(state)
        # while it runs: a second writer is refused, even with the opt-in, and changes nothing
        before = sorted(os.listdir(state / "rank0"))
        for choice in ("refuse", "discard"):
            with pytest.raises(StoreLockedError, match=f"process {proc.pid}"):
                ZeroMuon(model.named_parameters(), store=store, stale_store=choice)
        assert sorted(os.listdir(state / "rank0")) == before
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert (state / "rank0" / "muon_momentum" / "zarr.json").exists()  # one level per rank

    # without the opt-in: refused, naming the directory and how to resume
    refused = _run("refuse-resume", state, ck, tmp_path / "x.pt")
    assert refused.returncode != 0
    last = refused.stderr.strip().splitlines()[-1]
    assert "InputError" in last and str(state / "rank0") in last, last
    assert "earlier run" in last and "muon_momentum" in last
    assert 'stale_store="discard"' in last and "load_checkpoint" in last

    resumed = _run("resume", state, ck, tmp_path / "resumed.pt")
    assert resumed.returncode == 0, resumed.stderr
    straight = _run("straight", tmp_path / "state2", tmp_path / "ck2", tmp_path / "straight.pt")
    assert straight.returncode == 0, straight.stderr
    a = torch.load(tmp_path / "resumed.pt")
    b = torch.load(tmp_path / "straight.pt")
    for n in b["params"]:
        assert torch.equal(a["params"][n], b["params"][n]), n
    assert a["state"].keys() == b["state"].keys()
    for i in b["state"]:
        for k, v in b["state"][i].items():
            assert torch.equal(torch.as_tensor(a["state"][i][k]), torch.as_tensor(v)), (i, k)


def test_discard_removes_a_store_of_another_model_and_nothing_else(tmp_path):
    """The old store's arrays (another model: other shapes, master weights) go, with the
    old nested layout's rank group; files that are not the store's stay."""
    model, store = _model_and_store(tmp_path)
    other = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)).to(torch.bfloat16)
    with ZeroMuon(other.named_parameters(), store=store, master_weights=True) as opt:
        for p in other.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
    rank_dir = tmp_path / "rank0"
    assert (rank_dir / "master").is_dir()
    (rank_dir / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="earlier run"):
        ZeroMuon(model.named_parameters(), store=store)
    with ZeroMuon(model.named_parameters(), store=store, stale_store="discard") as opt:
        assert not (rank_dir / "master").exists()
        assert sorted(os.listdir(rank_dir)) == ["adam_exp_avg", "adam_exp_avg_sq",
                                                "muon_momentum", "notes.txt", "zarr.json"]
        assert all(bool((v == 0).all()) for s in opt.state_dict()["state"].values()
                   for k, v in s.items() if k != "step")


def test_discard_removes_a_store_of_the_old_nested_layout(tmp_path):
    """A store written before format version 3 (store/rank0/rank0/<array>, shard table in
    the nested group) is discarded whole; a directory holding an unknown zarr group is
    refused, never emptied."""
    from offload_engine.layout import create_group
    from offload_engine.store import TieredStore
    model, store = _model_and_store(tmp_path)
    rank_dir = tmp_path / "rank0"
    with TieredStore(dict(store, nvme_paths=[str(rank_dir)])) as s:  # the old names
        s.register("rank0/muon_momentum", torch.float32, 1000)
        s.update_manifest({"world_size": 1, "rank": 0, "tensors": {}, "step": 9})
    create_group(str(rank_dir / "rank0"), {"shards": {}}, exist_ok=True)
    with pytest.raises(ValueError, match="step 9"):
        ZeroMuon(model.named_parameters(), store=store)
    with ZeroMuon(model.named_parameters(), store=store, stale_store="discard"):
        assert not (rank_dir / "rank0").exists()
    foreign = tmp_path / "foreign"
    create_group(str(foreign / "rank0"), {"format": "something-else"})
    with pytest.raises(ValueError, match="not an offload-engine store"):
        ZeroMuon(model.named_parameters(), store=dict(store, nvme_paths=[str(foreign)]),
                 stale_store="discard")
    assert (foreign / "rank0" / "zarr.json").exists()
