"""offload-engine export: one tensor reassembled from its shards into .npy, .safetensors or
.pt, from every kind of input."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from safetensors import safe_open

from offload_engine.formats import open_source
from offload_engine.offline.export import export_tensor

from helpers.inspect_fixtures import FIXTURES, make_checkpoint, make_live_store, run_cli


def load(path: str, name: str) -> torch.Tensor:
    if path.endswith(".npy"):
        return torch.from_numpy(np.load(path))
    if path.endswith(".pt"):
        return torch.load(path, weights_only=True)
    with safe_open(path, "pt") as f:
        assert f.metadata()["format"] == "pt"
        return f.get_tensor(name)


@pytest.mark.parametrize("ext", [".npy", ".safetensors", ".pt"])
@pytest.mark.parametrize("kind", ["checkpoint", "store"])
def test_export_reassembles_shards(tmp_path, capsys, ext, kind):
    make = make_checkpoint if kind == "checkpoint" else make_live_store
    root, tensors = make(tmp_path / kind)
    for name, state in (("layers.1.attn.wq.weight", "momentum_buffer"), ("emb.weight", "exp_avg"),
                        ("scalar", "exp_avg_sq"), ("layers.0.norm.weight", None)):
        out = str(tmp_path / f"{name}-{state}{ext}")
        args = ["export", root, name, "--out", out] + (["--state", state] if state else [])
        rc, o, err = run_cli(args, capsys)
        assert rc == 0, err
        assert f"wrote {name}" in o
        want = tensors[name]["states"][state or "param"]
        got = load(out, name)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got, want)


def test_default_state_is_master_then_param(tmp_path, capsys):
    root, tensors = make_checkpoint(tmp_path / "c")
    out = str(tmp_path / "w.pt")
    rc, o, err = run_cli(["export", root, "emb.weight", "--out", out], capsys)
    assert rc == 0 and "(master," in o
    assert torch.equal(torch.load(out, weights_only=True), tensors["emb.weight"]["states"]["master"])


def test_bf16_to_npy_needs_a_cast(tmp_path, capsys):
    root, tensors = make_checkpoint(tmp_path / "c")
    out = str(tmp_path / "p.npy")
    rc, o, err = run_cli(["export", root, "emb.weight", "--state", "param", "--out", out], capsys)
    assert rc == 2 and "bfloat16" in err and not os.path.exists(out)
    rc, o, err = run_cli(["export", root, "emb.weight", "--state", "param", "--dtype", "float32",
                          "--out", out], capsys)
    assert rc == 0, err
    want = tensors["emb.weight"]["states"]["param"].float()
    assert torch.equal(torch.from_numpy(np.load(out)), want)


@pytest.mark.parametrize("fixture", ["zero1_w2_fp32", "zero3_w4_bf16"])
def test_export_from_deepspeed(tmp_path, capsys, fixture):
    path = os.path.join(FIXTURES, fixture)
    with open_source(path) as s:
        t = s.tensor("l1.weight")
        want = torch.empty(t.numel)
        s.read_state("l1.weight", "exp_avg_sq", 0, want)
    out = str(tmp_path / "v.safetensors")
    rc, o, err = run_cli(["export", path, "l1.weight", "--state", "exp_avg_sq", "--out", out], capsys)
    assert rc == 0, err
    assert torch.equal(load(out, "l1.weight"), want.reshape(13, 16))
    # a tied alias exports its owner; master weights equal zero_to_fp32's
    out = str(tmp_path / "head.npy")
    rc, o, err = run_cli(["export", path, "head.weight", "--out", out], capsys)
    assert rc == 0, err
    from safetensors.torch import load_file
    expected = load_file(os.path.join(path, "expected_zero_to_fp32.safetensors"))
    assert torch.equal(torch.from_numpy(np.load(out)), expected["head.weight"])


def test_export_from_safetensors(tmp_path, capsys):
    src = os.path.join(FIXTURES, "zero2_w3_fp32", "expected_zero_to_fp32.safetensors")
    out = str(tmp_path / "offs.pt")
    rc, o, err = run_cli(["export", src, "offs", "--out", out], capsys)
    assert rc == 0, err
    assert torch.load(out, weights_only=True).tolist() == [16777217]


def test_large_tensor_streams_in_windows(tmp_path):
    big = torch.randn(1 << 20)
    tensors = {"w": {"shape": [1024, 1024], "dtype": torch.float32, "optimizer": "muon",
                     "states": {"momentum_buffer": big.reshape(1024, 1024)}}}
    root, _ = make_checkpoint(tmp_path / "c", tensors, world_size=3)
    out = str(tmp_path / "w.npy")
    with open_source(root) as s:
        export_tensor(s, "w", out, window_bytes=64 << 10)
    assert torch.equal(torch.from_numpy(np.load(out)).reshape(-1), big)
