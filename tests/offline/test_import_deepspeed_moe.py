"""Importing DeepSpeed 0.19.8 mixture-of-experts runs (tests/fixtures/deepspeed_moe) and
resuming them with ZeroMuon: masters and Adam moments equal DeepSpeed's own, bitwise.

The ground truth is ``expected.safetensors`` beside each run: the fp32 masters
(``safe_get_full_fp32_param``) and the Adam moments DeepSpeed held at save time, under the
checkpoint's names (global expert ids). deepspeed is never imported.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from offload_engine.cli.main import main
from offload_engine.formats.ours import OursSource
from offload_engine.migrate import from_deepspeed, imported_state, use_muon_rule
from helpers.deepspeed_moe import AUTOEP, EP2_W4, MOE, RUNS, expected
from helpers.zero_muon_harness import spawn


def run_cli(capsys, *args: str):
    """(exit status, stderr) of ``offload-engine *args``, in this process."""
    rc = main(list(args))
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("world", [1, 3])
def test_imported_experts_hold_deepspeeds_masters_and_moments(tmp_path, run, world):
    """Every expert of every expert-parallel rank, and the dense parameters: master and
    both moments bitwise, step 2, AdamW, at a world size unlike the run's (windows of 64
    bytes: every tensor written in pieces)."""
    want = expected(run)
    summary = from_deepspeed(os.path.join(MOE, run), str(tmp_path), world, window_bytes=64)
    assert any("mixture-of-experts" in n for n in summary.notes)
    assert imported_state(str(tmp_path))["experts"] == (
        {f"model.layers.{i}.mlp.experts": 4 for i in (0, 1)} if run in AUTOEP else {"moe0": 4, "moe1": 4})
    bf16 = run.endswith("bf16")
    with OursSource.open_checkpoint(str(tmp_path)) as src:
        assert src.manifest.world_size == world and src.manifest.step == 2
        tensors = {t.name: t for t in src.tensors()}
        assert set(tensors) == set(want["master"]) | (set() if run in AUTOEP else {"scale"})
        for name, master in want["master"].items():
            meta = tensors[name]
            assert meta.optimizer == "adamw" and meta.extra.get("adam_step", 2.0) == 2.0
            assert meta.dtype.name == ("bfloat16" if bf16 else "float32")
            got = torch.empty(meta.numel)
            src.read_state(name, "master_param" if bf16 else "param", 0, got)
            assert torch.equal(got.view(master.shape), master), name
            for key in ("exp_avg", "exp_avg_sq"):
                got = torch.empty(meta.numel, dtype=meta.states[key].dtype.torch)
                src.read_state(name, key, 0, got)
                assert torch.equal(got.view(master.shape), want[key][name]), (name, key)


@pytest.mark.parametrize("run", ["zero2_ep2_w4_fp32", "zero2_ep2_w2_bf16", "zero3_autoep2_w4_fp32"])
def test_imported_checkpoint_consolidates_to_deepspeeds_weights(tmp_path, capsys, run):
    ckpt, out = str(tmp_path / "ck"), str(tmp_path / "out")
    rc, err = run_cli(capsys, "import", "deepspeed", os.path.join(MOE, run), ckpt, "--world-size", "2")
    assert rc == 0, err
    rc, err = run_cli(capsys, "consolidate", ckpt, out)
    assert rc == 0, err
    got = load_file(os.path.join(out, "model.safetensors"))
    for name, master in expected(run)["master"].items():
        assert torch.equal(got[name], master), name


def test_bad_moe_checkpoint_is_refused_and_nothing_written(tmp_path, capsys):
    """A missing expert file: one line naming it, exit 2; a fresh OUT is not created, an
    existing one keeps exactly what it held."""
    ck = str(tmp_path / "ds")
    shutil.copytree(EP2_W4, ck)
    gone = os.path.join(ck, "global_step2", "layer_0_expert_3_mp_rank_00_model_states.pt")
    os.remove(gone)
    rc, err = run_cli(capsys, "import", "deepspeed", ck, str(tmp_path / "new"), "--world-size", "2")
    assert rc == 2 and gone in err and "missing expert file" in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "new").exists()
    old = tmp_path / "old"
    old.mkdir()
    (old / "notes.txt").write_text("mine")
    rc, err = run_cli(capsys, "import", "deepspeed", ck, str(old), "--world-size", "2")
    assert rc == 2 and gone in err
    assert os.listdir(old) == ["notes.txt"] and (old / "notes.txt").read_text() == "mine"


# -- resuming with ZeroMuon in real processes -----------------------------------------------------
def model_named_like(tensors: dict[str, torch.Tensor]) -> nn.Module:
    """A module tree holding a zero parameter under each dotted name of ``tensors`` (DeepSpeed
    MoE's ``moe0.deepspeed_moe.experts.deepspeed_experts.3.w1.weight``, AutoEP's grouped
    ``model.layers.0.mlp.experts.w1``), built without deepspeed."""
    root = nn.Module()
    for name, value in tensors.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(torch.zeros_like(value)))
    return root


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _rows(full, rank, world):
    chunks = list(torch.chunk(full, world, dim=0))
    return chunks[rank] if rank < len(chunks) else full[full.shape[0]:]


def _resume(rank, world, mesh, ckpt, run):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard
    from offload_engine.checkpoint import load_checkpoint
    from offload_engine.optim import ZeroMuon

    want = expected(run)
    model = model_named_like(want["master"])
    if run not in AUTOEP:
        model.register_buffer("scale", torch.zeros(8))  # the native runs' float buffer
    fully_shard(model, mesh=mesh)
    named = dict(model.named_parameters())
    assert set(named) == set(want["master"])
    opt = ZeroMuon(model.named_parameters(), adamw=dict(lr=0.01, betas=(0.9, 0.98), eps=1e-8,
                                                       weight_decay=0.01),
                   use_muon_rule=use_muon_rule(ckpt))
    assert load_checkpoint(ckpt, model, opt) == 2
    if run not in AUTOEP:
        assert torch.equal(model.scale, torch.linspace(0.5, 1.5, 8))
    index = {i.name: i.index for i in opt.infos}
    assert all(i.kind == "adamw" for i in opt.infos)  # the run's choice, experts included
    sd = opt.state_dict()["state"]
    for name, master in want["master"].items():
        assert torch.equal(_local(named[name]), _rows(master, rank, world)), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(_local(sd[index[name]][key]), _rows(want[key][name], rank, world))
        assert float(sd[index[name]]["step"]) == 2.0
    # one more step: torch.optim.AdamW from DeepSpeed's saved state, bitwise
    ref = {n: nn.Parameter(m.clone()) for n, m in want["master"].items()}
    ref_opt = torch.optim.AdamW(list(ref.values()), lr=0.01, betas=(0.9, 0.98), eps=1e-8,
                                weight_decay=0.01)
    for n, p in ref.items():
        ref_opt.state[p] = {"step": torch.tensor(2.0), "exp_avg": want["exp_avg"][n].clone(),
                            "exp_avg_sq": want["exp_avg_sq"][n].clone()}
    gen = torch.Generator().manual_seed(7)
    for n, p in ref.items():
        p.grad = torch.randn(p.shape, generator=gen) * 0.01
        q = named[n]
        q.grad = DTensor.from_local(_rows(p.grad, rank, world).clone(), q.device_mesh, (Shard(0),),
                                    run_check=False, shape=q.shape, stride=q.stride())
    opt.step()
    ref_opt.step()
    for n, p in ref.items():
        assert torch.equal(_local(named[n]), _rows(p.detach(), rank, world)), n
    opt.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", ["zero2_ep2_w4_fp32", "zero3_autoep2_w4_fp32"])
def test_imported_moe_run_resumes_bitwise(tmp_path, run):
    """Imported from an expert-parallel run (ep 2 x expert data-parallel 2; native MoE's
    per-expert tensors, AutoEP's grouped [4, out, in] stacks) at W=2 under FSDP2: ZeroMuon
    loads DeepSpeed's masters and moments into a model with DeepSpeed's parameter names, and
    its next step equals torch.optim.AdamW's from that state, bit for bit."""
    ckpt = str(tmp_path / "ck")
    from_deepspeed(os.path.join(MOE, run), ckpt, 2)
    spawn(2, _resume, ckpt, run)
