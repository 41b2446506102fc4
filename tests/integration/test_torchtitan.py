"""torchtitan 0.3.0 as a client (docs/torchtitan.md): ZeroMuon built by torchtitan's optimizer
container from its config, on torchtitan's llama3 debug model parallelized by its own
parallelize_llama (FSDP, and FSDP + tensor parallel) on a CPU gloo mesh, saved by its
CheckpointManager, SIGKILLed, and resumed bit for bit (tests/helpers/torchtitan_run.py)."""

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from helpers.paths import child_env, script
from offload_engine.errors import InputError

pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 (installed by ./quickstart.sh)")

from torchtitan.components.optimizer import ParamGroupConfig  # noqa: E402

from offload_engine.integrations.torchtitan import (ZeroMuonOptimizersContainer,  # noqa: E402
                                                    build_zero_muon)
from offload_engine.optim import ZeroMuon  # noqa: E402

RUN = script("torchtitan_run.py")
STEPS, SAVED_AT, KILLED_AFTER = 6, 3, 4


def torchrun(out, world: int, tp: int, tag: str, *extra) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(world), RUN, "--out", str(out), "--tp", str(tp), "--steps", str(STEPS),
           "--tag", tag, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400,
                          env=child_env({**os.environ, "OMP_NUM_THREADS": "1"}))


def losses(out, tag: str) -> dict[int, str]:
    """step -> the loss as float.hex(), as rank 0 wrote it."""
    with open(os.path.join(out, f"losses-{tag}.txt")) as f:
        return {int(step): loss for step, loss in (line.split() for line in f)}


def saved_keys(folder) -> set[str]:
    import torch.distributed.checkpoint as dcp
    return set(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world,tp", [
    (2, 1),
    # slow: the marker guard counts what the waited-for children read and send (their
    # imports of torch, triton and torchtitan, and gloo's traffic): 5 processes a run, over 1 GiB
    pytest.param(4, 2, marks=pytest.mark.slow)], ids=["fsdp", "fsdp+tp"])
def test_trains_saves_is_killed_and_resumes_bit_for_bit(tmp_path, world, tp):
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    whole.mkdir(), crashed.mkdir()
    done = torchrun(whole, world, tp, "whole")
    assert done.returncode == 0, done.stderr[-4000:]
    want = losses(whole, "whole")
    assert sorted(want) == list(range(1, STEPS + 1))
    first, last = float.fromhex(want[1]), float.fromhex(want[STEPS])
    assert last < 0.8 * first, f"the loss should fall: {first} -> {last}"

    killed = torchrun(crashed, world, tp, "killed", "--save-at", str(SAVED_AT),
                      "--kill-after", str(KILLED_AFTER))
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr[-4000:]
    assert losses(crashed, "killed") == {s: want[s] for s in range(1, KILLED_AFTER + 1)}
    checkpoint = crashed / "ckpt" / f"step-{SAVED_AT}"
    keys = saved_keys(checkpoint)
    # ZeroMuon's state, saved by torchtitan's CheckpointManager under its flat FQN keys:
    # Muon momentum for a hidden matrix, Adam moments for the embedding (names by rule)
    assert "optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.momentum_buffer" in keys
    assert "optimizer.state.tok_embeddings.weight.exp_avg_sq" in keys
    assert "optimizer.state.tok_embeddings.weight.momentum_buffer" not in keys
    for r in range(world):  # each rank's state lived in its own store
        assert (crashed / "store" / f"rank{r}").is_dir()

    resumed = torchrun(crashed, world, tp, "resumed", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert losses(crashed, "resumed") == {s: want[s] for s in range(SAVED_AT + 1, STEPS + 1)}


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(16, 8)
        self.hidden = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 16, bias=False)

    def forward(self, tokens):
        return self.lm_head(torch.relu(self.hidden(self.tok_embeddings(tokens))))


def zero_muon_entry(pattern=r".*", **options) -> ParamGroupConfig:
    return ParamGroupConfig(pattern=pattern, optimizer_name="ZeroMuon",
                            optimizer_kwargs={"lr": 0.02, "adamw": {"lr": 1e-3}, **options})


def test_the_container_builds_zero_muon_beside_torchtitans_own_optimizers():
    """A config mixing torchtitan's AdamW (for the head, by pattern) with ZeroMuon (the rest):
    each parameter is where the patterns put it, ZeroMuon splits its own between Muon and
    AdamW by name, and the container's flat state dict (what CheckpointManager saves) loads
    back into a fresh container bit for bit."""
    def build(seed):
        torch.manual_seed(seed)
        model = Tiny()
        config = ZeroMuonOptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=r"^lm_head\.", optimizer_name="AdamW",
                                           optimizer_kwargs={"lr": 1e-3}),
                          zero_muon_entry()],
            implementation="for-loop")
        return model, config.build(model_parts=[model])

    model, container = build(0)
    adamw, zero_muon = container.optimizers
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(zero_muon, ZeroMuon)
    assert [p for g in adamw.param_groups for p in g["params"]] == [model.lm_head.weight]
    muon = {id(p) for g in zero_muon.param_groups if g["use_muon"] for p in g["params"]}
    assert muon == {id(model.hidden.weight)}
    for _ in range(2):
        model(torch.randint(0, 16, (4, 5))).logsumexp(-1).mean().backward()
        container.step()
        container.zero_grad()
    saved = container.state_dict()
    assert "state.hidden.weight.momentum_buffer" in saved
    assert "state.tok_embeddings.weight.exp_avg" in saved

    fresh_model, fresh = build(1)
    fresh.load_state_dict(saved)
    again = fresh.state_dict()
    assert saved.keys() == again.keys()
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, again[key]), key
    container.close()
    fresh.close()


def test_zero_muon_entries_must_agree_and_options_go_in_one_place():
    model = Tiny()
    groups = [{"params": [model.hidden.weight], "param_names": ["hidden.weight"],
               "fused": False, "foreach": False, "lr": 0.02},
              {"params": [model.hidden.bias], "param_names": ["hidden.bias"],
               "fused": False, "foreach": False, "lr": 0.01}]
    with pytest.raises(InputError, match="same optimizer_kwargs"):
        build_zero_muon(groups)
    with pytest.raises(InputError, match=r"\['lr'\] given both"):
        build_zero_muon(groups[:1], lr=0.1)
    with pytest.raises(InputError, match="param_names"):
        build_zero_muon([{"params": [model.hidden.weight], "lr": 0.02}])
    with build_zero_muon(groups[:1], master_weights=False) as opt:
        assert opt.param_groups[0]["lr"] == 0.02 and opt.param_groups[0]["use_muon"]


def test_each_model_part_gets_a_store_folder_of_its_own(tmp_path):
    """Pipeline stages: torchtitan builds one ZeroMuon per model part on a rank, from one
    store config; each gets <path>/part<i> (a shared folder would be refused as in use)."""
    parts = [Tiny(), Tiny()]
    config = ZeroMuonOptimizersContainer.Config(
        param_groups=[zero_muon_entry()], implementation="for-loop",
        optimizer_factory_kwargs_by_name={"ZeroMuon": {"store": {
            "nvme_paths": [str(tmp_path)], "cpu_budget": "64KiB", "bucket_bytes": "4KiB"}}})
    container = config.build(model_parts=parts)
    try:
        assert len(container.optimizers) == 2
        for part in parts:
            part(torch.randint(0, 16, (2, 3))).sum().backward()
        container.step()
        for i in range(2):
            assert (tmp_path / f"part{i}" / "rank0").is_dir()
    finally:
        container.close()


def test_the_config_lines_of_the_docs_build_zero_muon(tmp_path):
    """docs/torchtitan.md's switch, as written, on a config object standing in for
    llama3_debugmodel()'s Trainer.Config (torchtitan's Trainer cannot be imported here)."""
    import re
    from types import SimpleNamespace

    from helpers.paths import ROOT

    with open(os.path.join(ROOT, "docs", "torchtitan.md")) as f:
        (code,) = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    code = code.replace("/nvme/zeromuon", str(tmp_path))
    scope = {"llama3_debugmodel": SimpleNamespace}
    exec(compile(code, "docs/torchtitan.md", "exec"), scope)
    container = scope["config"].optimizer.build(model_parts=[Tiny()])
    try:
        (optimizer,) = container.optimizers
        assert isinstance(optimizer, ZeroMuon)
        assert (tmp_path / "rank0").is_dir()
    finally:
        container.close()
