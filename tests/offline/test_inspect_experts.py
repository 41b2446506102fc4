"""inspect, diff and export of mixture-of-experts checkpoints: grouped stacks listed by name,
shape and expert count, and ``--expert E`` (the same option in the three commands)
selecting one expert: a stack's slice ``NAME[E]`` and the per-expert tensors of expert E.

The checkpoint is our format over 4 ranks with 5 experts per stack, split on the expert
dimension as FSDP2 splits rows (2 + 2 + 1 + 0): expert 1 is the second of rank 0's shard,
expert 4 is rank 2's, rank 3 holds none.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from helpers.inspect_fixtures import assert_one_line_error, make_checkpoint, run_cli

W1, W2 = "layers.0.moe.experts.w1", "layers.0.moe.experts.w2"
PER_EXPERT = "layers.1.mlp.experts.{e}.up_proj.weight"


def moe_tensors(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    out = {
        W1: {"shape": [5, 6, 4], "dtype": torch.float32, "optimizer": "muon",
             "states": {"param": rand(5, 6, 4), "momentum_buffer": rand(5, 6, 4)}},
        W2: {"shape": [5, 4, 6], "dtype": torch.float32, "optimizer": "adamw",
             "states": {"param": rand(5, 4, 6), "exp_avg": rand(5, 4, 6),
                        "exp_avg_sq": rand(5, 4, 6).abs()}},
        "layers.0.moe.router.gate.weight": {
            "shape": [5, 4], "dtype": torch.float32, "optimizer": "muon",
            "states": {"param": rand(5, 4), "momentum_buffer": rand(5, 4)}},
    }
    for e in range(3):
        out[PER_EXPERT.format(e=e)] = {"shape": [6, 4], "dtype": torch.float32,
                                       "optimizer": "muon",
                                       "states": {"param": rand(6, 4), "momentum_buffer": rand(6, 4)}}
    return out


@pytest.fixture
def checkpoint(tmp_path):
    return make_checkpoint(tmp_path / "ckpt", moe_tensors())


def test_inspect_lists_stacks_with_their_expert_count(checkpoint, capsys):
    root, _ = checkpoint
    rc, out, err = run_cli(["inspect", root, "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    rows = {r["name"]: r for r in doc["tensors"]}
    assert rows[W1]["shape"] == [5, 6, 4] and rows[W1]["experts"] == 5
    assert "experts" not in rows["layers.0.moe.router.gate.weight"]
    assert "experts" not in rows[PER_EXPERT.format(e=1)]  # 2-D: already one per expert
    assert doc["summary"]["expert_stacks"] == {"count": 2, "experts": [5]}
    rc, out, _ = run_cli(["inspect", root], capsys)
    assert "experts     2 grouped stack(s) of 5 experts" in out


@pytest.mark.parametrize("expert", [1, 4])
def test_inspect_one_expert_lists_and_reads_its_slice(checkpoint, capsys, expert):
    root, tensors = checkpoint
    rc, out, err = run_cli(["inspect", root, "--expert", expert, "--stats", "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    names = [r["name"] for r in doc["tensors"]]
    want = [f"{W1}[{expert}]", f"{W2}[{expert}]"]
    if expert < 3:
        want.append(PER_EXPERT.format(e=expert))
    assert sorted(names) == sorted(want)
    assert {r["name"]: r["shape"] for r in doc["tensors"]}[f"{W2}[{expert}]"] == [4, 6]
    stats = {(s["name"], s["state"]): s for s in doc["stats"]}
    for name, state in ((W1, "momentum_buffer"), (W2, "exp_avg_sq")):
        part = tensors[name]["states"][state][expert]
        s = stats[(f"{name}[{expert}]", state)]
        assert s["count"] == part.numel()
        assert s["min"] == part.min().item() and s["max"] == part.max().item()
    # --name globs match a slice by its stack's name
    rc, out, _ = run_cli(["inspect", root, "--expert", expert, "--name", "*.w1", "--json"], capsys)
    assert [r["name"] for r in json.loads(out)["tensors"]] == [f"{W1}[{expert}]"]


@pytest.mark.parametrize("name", [W2, f"{W2}[4]"])
def test_export_one_expert(checkpoint, tmp_path, capsys, name):
    root, tensors = checkpoint
    out = str(tmp_path / "e4.npy")
    rc, o, err = run_cli(["export", root, name, "--expert", 4, "--state", "exp_avg",
                          "--out", out], capsys)
    assert rc == 0, err
    assert f"wrote {W2}[4] (exp_avg, shape [4, 6]" in o
    assert torch.equal(torch.from_numpy(np.load(out)), tensors[W2]["states"]["exp_avg"][4])
    # the weights by default; a per-expert tensor of that expert by its own name
    rc, o, err = run_cli(["export", root, PER_EXPERT.format(e=2), "--expert", 2, "--out", out],
                         capsys)
    assert rc == 0, err
    assert torch.equal(torch.from_numpy(np.load(out)),
                       tensors[PER_EXPERT.format(e=2)]["states"]["param"])


def test_diff_one_expert(checkpoint, tmp_path, capsys):
    """A safetensors copy whose expert 2 differs: diff --expert 1 is equal, --expert 2 not."""
    root, tensors = checkpoint
    weights = {n: t["states"]["param"].clone() for n, t in tensors.items()}
    weights[W1][2, 3, 1] += 1.0
    st = str(tmp_path / "copy.safetensors")
    save_file(weights, st, metadata={"format": "pt"})
    rc, out, err = run_cli(["diff", root, st, "--expert", 1], capsys)
    assert rc == 0, out + err
    rc, out, err = run_cli(["diff", root, st, "--expert", 2, "--json"], capsys)
    assert rc == 1, err
    doc = json.loads(out)
    assert [v["name"] for v in doc["values"] if not v["equal"]] == [f"{W1}[2]"]
    assert [v["mismatches"] for v in doc["values"] if not v["equal"]] == [1]


@pytest.mark.parametrize("command", ["inspect", "diff", "export"])
def test_an_expert_no_stack_holds_is_one_line(checkpoint, tmp_path, capsys, command):
    root, _ = checkpoint
    args = {"inspect": ["inspect", root], "diff": ["diff", root, root],
            "export": ["export", root, W1, "--out", str(tmp_path / "x.npy")]}[command]
    rc, _, err = run_cli(args + ["--expert", 5], capsys)
    assert_one_line_error(rc, err, root, "no expert 5", "hold 5 experts")
    assert not os.path.exists(tmp_path / "x.npy")


def test_export_of_a_tensor_that_is_not_of_the_expert(checkpoint, tmp_path, capsys):
    root, _ = checkpoint
    rc, _, err = run_cli(["export", root, "layers.0.moe.router.gate.weight", "--expert", 1,
                          "--out", str(tmp_path / "x.npy")], capsys)
    assert_one_line_error(rc, err, "layers.0.moe.router.gate.weight", "expert 1")


@pytest.mark.parametrize("experts", [4, 6])
def test_stack_whose_expert_count_disagrees_with_its_shards(checkpoint, tmp_path, capsys, experts):
    """The manifest says the stack holds ``experts`` experts, the ranks' shards hold 5:
    consolidate and export refuse in one line naming the tensor, and write nothing."""
    from helpers.synthetic import reseal
    root, _ = checkpoint
    gen = os.path.join(root, open(os.path.join(root, "latest")).read().strip())
    with open(os.path.join(gen, "zarr.json")) as f:
        doc = json.load(f)
    doc["attributes"]["tensors"][W1]["shape"][0] = experts
    with open(os.path.join(gen, "zarr.json"), "w") as f:
        json.dump(doc, f)
    reseal(gen)  # as a forger would: the shards, not the checksums, must catch it
    out = tmp_path / "hf"
    rc, _, err = run_cli(["consolidate", root, out], capsys)
    assert_one_line_error(rc, err, W1)
    assert not out.exists() or not os.listdir(out)
    rc, _, err = run_cli(["export", root, W1, "--expert", 1, "--out", tmp_path / "x.npy"], capsys)
    assert_one_line_error(rc, err, W1)
    assert not os.path.exists(tmp_path / "x.npy")


def test_per_expert_names_of_every_spelling(tmp_path, capsys):
    """Per-expert tensors are expert E's by their name: Hugging Face 4.x ``experts.E.`` and
    DeepSpeed's ``deepspeed_experts.E.``; ``experts.1`` is not expert 12's."""
    names = ["model.layers.0.mlp.experts.1.gate_proj.weight",
             "model.layers.0.mlp.experts.12.gate_proj.weight",
             "moe0.deepspeed_moe.experts.deepspeed_experts.1.w1.weight",
             "moe0.deepspeed_moe.gate.wg.weight"]
    st = str(tmp_path / "m.safetensors")
    save_file({n: torch.full((2, 3), float(i)) for i, n in enumerate(names)}, st)
    rc, out, err = run_cli(["inspect", st, "--expert", 1, "--json"], capsys)
    assert rc == 0, err
    assert sorted(r["name"] for r in json.loads(out)["tensors"]) == sorted([names[0], names[2]])


def test_inspect_text_names_the_expert(checkpoint, capsys):
    root, _ = checkpoint
    rc, out, err = run_cli(["inspect", root, "--expert", 3], capsys)
    assert rc == 0, err
    assert "expert      3 (a stack's slice is listed as NAME[3])" in out
    row = next(line for line in out.splitlines() if line.startswith(f"{W2}[3]"))
    assert row.split()[1:3] == ["[4,", "6]"] and "exp_avg_sq" in row
