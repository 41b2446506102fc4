"""offload-engine diff: across kinds (our checkpoint vs its consolidated safetensors, a
DeepSpeed checkpoint vs ours, DeepSpeed vs zero_to_fp32's output), tolerances, and every
kind of change."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from offload_engine.offline.consolidate import consolidate
from offload_engine.formats.deepspeed import DeepSpeedSource
from offload_engine.formats import open_source
from offload_engine.offline.diff import diff_sources

from helpers.inspect_fixtures import (DS_ALL, FIXTURES, make_checkpoint, make_live_store,
                                   model_tensors, run_cli)


def weights_of(tensors: dict) -> dict:
    """What a consolidation of our checkpoint holds: master weights, else the parameter."""
    out = {}
    for name, spec in tensors.items():
        st = spec["states"]
        out[name] = (st["master"] if "master" in st else st["param"]).clone().contiguous()
    return out


def test_checkpoint_against_its_consolidated_safetensors(tmp_path, capsys):
    root, tensors = make_checkpoint(tmp_path / "ckpt")
    st = tmp_path / "model.safetensors"
    save_file(weights_of(tensors), str(st), metadata={"format": "pt"})
    rc, out, err = run_cli(["diff", root, st], capsys)
    assert rc == 0, out + err
    assert "equal within tolerance" in out and "compared 6 tensor states (weights)" in out
    rc, out, err = run_cli(["diff", st, root], capsys)
    assert rc == 0, out + err


@pytest.mark.parametrize("fixture", DS_ALL)
def test_deepspeed_against_zero_to_fp32_output(fixture, capsys):
    path = os.path.join(FIXTURES, fixture)
    expected = os.path.join(path, "expected_zero_to_fp32.safetensors")
    rc, out, err = run_cli(["diff", path, expected, "--json"], capsys)
    doc = json.loads(out)
    # head.weight is tied to emb.weight in the checkpoint and a copy in zero_to_fp32's output
    assert doc["added"] == []
    assert all(v["equal"] and v["max_abs"] == 0 for v in doc["values"])
    args = ["diff", path, expected]
    if fixture.startswith("zero1"):
        # ZeRO-1 records no frozen_param_shapes: zero_to_fp32 drops the frozen layer
        assert rc == 1 and doc["removed"] == ["frozen.bias", "frozen.weight"]
        args += ["--name", "[!f]*"]
    elif "bf16" in fixture:
        # zero_to_fp32 writes every float tensor in fp32, the bf16 frozen layer included
        assert rc == 1 and {(c["name"], c["what"], c["a"], c["b"]) for c in doc["changed"]} == {
            ("frozen.weight", "dtype", "bfloat16", "float32"),
            ("frozen.bias", "dtype", "bfloat16", "float32")}
        args += ["--ignore-dtype"]
    rc, out, err = run_cli(args, capsys)
    assert rc == 0, out + err


def test_deepspeed_against_its_consolidated_output(tmp_path, capsys):
    ds = os.path.join(FIXTURES, "zero3_w3_fp32")
    with DeepSpeedSource(ds) as src:
        consolidate(src, str(tmp_path / "hf"), max_shard_bytes=2000)
    rc, out, err = run_cli(["diff", ds, tmp_path / "hf"], capsys)
    assert rc == 0, out + err


def ds_as_our_checkpoint(ds_path: str, root, world_size: int) -> None:
    """Copy every state of a DeepSpeed checkpoint into our checkpoint format."""
    tensors = {}
    with open_source(ds_path) as s:
        for t in s.tensors():
            states = {}
            for st, meta in t.states.items():
                v = torch.empty(t.numel, dtype=meta.dtype.torch)
                s.read_state(t.name, st, 0, v)
                states[st] = v.reshape(t.shape)
            tensors[t.name] = {"shape": list(t.shape), "dtype": t.dtype.torch,
                               "optimizer": t.optimizer, "states": states}
        for alias, owner in s.aliases().items():  # our format has no ties: a copy
            tensors[alias] = tensors[owner]
    make_checkpoint(root, tensors, world_size=world_size, step=2)


@pytest.mark.parametrize("fixture", ["zero2_w3_fp32", "zero3_w4_bf16"])
def test_deepspeed_against_ours(fixture, tmp_path, capsys):
    ds = os.path.join(FIXTURES, fixture)
    ds_as_our_checkpoint(ds, tmp_path / "ours", world_size=2)  # another world size
    rc, out, err = run_cli(["diff", ds, tmp_path / "ours", "--state", "all", "--json"], capsys)
    assert rc == 0, out + err
    doc = json.loads(out)
    states = {(v["name"], v["state"]) for v in doc["values"]}
    assert ("emb.weight", "exp_avg_sq") in states and ("offs", "param") in states
    # one changed value is found, and a tolerance wide enough accepts it
    from offload_engine.layout import FlatArray
    from offload_engine.io import AsyncFileIO
    from helpers.synthetic import chunk_checksums, reseal
    from offload_engine.layout import read_group, write_group_attributes
    gen = os.path.join(tmp_path / "ours", "step-00000002")
    with AsyncFileIO() as io:
        arr = FlatArray.open(os.path.join(gen, "rank1", "exp_avg"), io=io, mode="r+")
        v = arr.read(0, 1)
        arr.write(0, v + 1e-3)
        arr.sync().result()
        attrs = read_group(gen)
        attrs["checksums"]["rank1/exp_avg"] = chunk_checksums(arr)
        write_group_attributes(gen, attrs)
    reseal(gen)
    rc, out, err = run_cli(["diff", ds, tmp_path / "ours", "--state", "exp_avg"], capsys)
    assert rc == 1
    assert "different: 1 tensor state(s) outside tolerance" in out
    rc, out, err = run_cli(["diff", ds, tmp_path / "ours", "--state", "exp_avg",
                            "--atol", "2e-3"], capsys)
    assert rc == 0, out


def test_value_change_and_tolerances(tmp_path, capsys):
    a = model_tensors(0)
    b = model_tensors(0)
    m = b["layers.1.attn.wq.weight"]["states"]["master"]
    m[5, 5] += 0.5
    root_a, _ = make_checkpoint(tmp_path / "a", a)
    root_b, _ = make_checkpoint(tmp_path / "b", b)
    with open_source(root_a) as sa, open_source(root_b) as sb:
        r = diff_sources(sa, sb)
        assert not r.equal
        [bad] = [v for v in r.values if not v["equal"]]
        assert bad["name"] == "layers.1.attn.wq.weight" and bad["mismatches"] == 1
        assert bad["max_abs"] == pytest.approx(0.5)
        want = 0.5 / float(m.double().norm())
        assert bad["rel_l2"] == pytest.approx(want, rel=1e-6)
        assert diff_sources(sa, sb, atol=0.5000001).equal
        assert diff_sources(sa, sb, rtol=0.0, atol=0.4).equal is False
    rc, out, err = run_cli(["diff", root_a, root_b], capsys)
    assert rc == 1 and "layers.1.attn.wq.weight" in out and "0.5" in out


def test_names_shapes_dtypes_and_states(tmp_path, capsys):
    a = model_tensors(0)
    b = model_tensors(0)
    del b["scalar"]
    b["extra.bias"] = {"shape": [3], "dtype": torch.float32, "optimizer": "adamw",
                       "states": {"param": torch.ones(3)}}
    b["emb.weight"]["states"]["master"] = b["emb.weight"]["states"]["master"][:36].clone()
    b["emb.weight"]["states"]["param"] = b["emb.weight"]["states"]["param"][:36].clone()
    b["emb.weight"]["states"]["exp_avg"] = b["emb.weight"]["states"]["exp_avg"][:36].clone()
    b["emb.weight"]["states"]["exp_avg_sq"] = b["emb.weight"]["states"]["exp_avg_sq"][:36].clone()
    b["emb.weight"]["shape"] = [36, 16]
    b["layers.0.norm.weight"]["states"]["param"] = b["layers.0.norm.weight"]["states"]["param"].double()
    del b["layers.1.norm.weight"]["states"]["exp_avg_sq"]
    root_a, _ = make_checkpoint(tmp_path / "a", a)
    root_b, _ = make_checkpoint(tmp_path / "b", b)
    rc, out, err = run_cli(["diff", root_a, root_b, "--state", "all", "--json"], capsys)
    assert rc == 1
    doc = json.loads(out)
    assert doc["removed"] == ["scalar"] and doc["added"] == ["extra.bias"]
    changed = {(c["name"], c["what"]) for c in doc["changed"]}
    assert changed == {("emb.weight", "shape"), ("layers.0.norm.weight", "dtype"),
                       ("layers.1.norm.weight", "states")}
    # the float64 copy holds the same values: only the dtype differs
    norm = [v for v in doc["values"] if v["name"] == "layers.0.norm.weight" and v["state"] == "param"]
    assert norm[0]["equal"]
    rc, out, err = run_cli(["diff", root_a, root_b, "--name", "layers.0.*", "--ignore-dtype"],
                           capsys)
    assert rc == 0, out


def test_nan_equals_nan_and_store_against_checkpoint(tmp_path, capsys):
    t = model_tensors(0)
    t["layers.0.attn.wq.weight"]["states"]["momentum_buffer"][0, 0] = float("nan")
    root_c, _ = make_checkpoint(tmp_path / "c", t)
    root_s, _ = make_live_store(tmp_path / "s", t)
    rc, out, err = run_cli(["diff", root_s, root_c, "--state", "all"], capsys)
    assert rc == 0, out + err


def test_bad_options(tmp_path, capsys):
    root, _ = make_checkpoint(tmp_path / "a")
    rc, out, err = run_cli(["diff", root, root, "--rtol", "-1"], capsys)
    assert rc == 2 and "--rtol" in err
    rc, out, err = run_cli(["diff", root, root, "--state", "all", "--state", "exp_avg"], capsys)
    assert rc == 2
