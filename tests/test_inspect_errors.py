"""Corrupt, incomplete or hostile input to inspect / diff / export: one line on stderr, exit
code 2, no traceback, nothing executed, no partial output file."""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import torch

from test_inspect_fixtures import (FIXTURES, assert_one_line_error, copy_fixture,
                                   make_checkpoint, make_live_store, run_cli)


@pytest.fixture
def ckpt(tmp_path):
    return make_checkpoint(tmp_path / "ckpt")[0]


def gen_dir(root: str) -> str:
    return glob.glob(os.path.join(root, "step-*"))[0]


def a_chunk(root: str, array: str = "rank1/master", index: int = 0) -> str:
    return os.path.join(gen_dir(root), array, "c", str(index))


COMMANDS = [
    lambda p, t: ["inspect", p, "--stats"],
    lambda p, t: ["export", p, "layers.0.attn.wq.weight", "--state", "master", "--out",
                  os.path.join(t, "out.npy")],
    lambda p, t: ["diff", p, p],
]


@pytest.mark.parametrize("command", range(3), ids=["inspect", "export", "diff"])
def test_bad_checksum_names_the_chunk(ckpt, tmp_path, capsys, command):
    chunk = a_chunk(ckpt)
    with open(chunk, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x01]))
    rc, out, err = run_cli(COMMANDS[command](ckpt, str(tmp_path)), capsys)
    assert_one_line_error(rc, err, chunk, "bad checksum")
    assert not os.path.exists(tmp_path / "out.npy")
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


@pytest.mark.parametrize("command", range(3), ids=["inspect", "export", "diff"])
def test_truncated_chunk(ckpt, tmp_path, capsys, command):
    chunk = a_chunk(ckpt)
    os.truncate(chunk, 1000)
    rc, out, err = run_cli(COMMANDS[command](ckpt, str(tmp_path)), capsys)
    assert_one_line_error(rc, err, chunk, "truncated chunk")


def test_truncated_chunk_in_live_store(tmp_path, capsys):
    root, _ = make_live_store(tmp_path / "store")
    chunk = os.path.join(root, "rank0", "master", "c", "0")
    os.truncate(chunk, 4096)
    rc, out, err = run_cli(["inspect", root, "--stats"], capsys)
    assert_one_line_error(rc, err, chunk, "truncated chunk")


def test_missing_chunk_with_a_checksum(ckpt, capsys):
    chunk = a_chunk(ckpt)
    os.unlink(chunk)
    rc, out, err = run_cli(["inspect", ckpt, "--stats"], capsys)
    assert_one_line_error(rc, err, chunk, "chunk file missing")


@pytest.mark.parametrize("target", ["group", "array"])
def test_broken_json(ckpt, capsys, target):
    where = gen_dir(ckpt) if target == "group" else os.path.join(gen_dir(ckpt), "rank2", "exp_avg")
    path = os.path.join(where, "zarr.json")
    text = open(path).read()
    with open(path, "w") as f:
        f.write(text[: len(text) // 2])
    rc, out, err = run_cli(["inspect", ckpt], capsys)
    assert_one_line_error(rc, err, path, "not valid JSON")


def test_missing_rank(ckpt, capsys):
    shutil.rmtree(os.path.join(gen_dir(ckpt), "rank3"))
    rc, out, err = run_cli(["inspect", ckpt], capsys)
    assert_one_line_error(rc, err, "rank3", "missing")


def test_manifest_missing_a_shard(ckpt, capsys):
    from offload_engine.layout import read_group, write_group_attributes
    g = gen_dir(ckpt)
    attrs = read_group(g)
    shards = attrs["tensors"]["layers.0.attn.wq.weight"]["shards"]
    attrs["tensors"]["layers.0.attn.wq.weight"]["shards"] = [s for s in shards if s["rank"] != 2]
    write_group_attributes(g, attrs)
    rc, out, err = run_cli(["inspect", ckpt], capsys)
    assert_one_line_error(rc, err, "layers.0.attn.wq.weight", "rows [24, 36) are in no shard")


def test_uncommitted_generation(ckpt, capsys):
    from offload_engine.layout import read_group, write_group_attributes
    g = gen_dir(ckpt)
    attrs = read_group(g)
    attrs["committed"] = False
    write_group_attributes(g, attrs)
    rc, out, err = run_cli(["inspect", ckpt], capsys)
    assert_one_line_error(rc, err, "not committed")


def test_latest_names_a_missing_generation(ckpt, capsys):
    with open(os.path.join(ckpt, "latest"), "w") as f:
        f.write("step-00000099\n")
    rc, out, err = run_cli(["inspect", ckpt], capsys)
    assert_one_line_error(rc, err, "step-00000099", "does not exist")


def test_unknown_input(tmp_path, capsys):
    (tmp_path / "x.bin").write_bytes(b"abc")
    for path in (tmp_path / "x.bin", tmp_path / "nope", tmp_path):
        rc, out, err = run_cli(["inspect", path], capsys)
        assert_one_line_error(rc, err, str(path))


def test_deepspeed_missing_rank(tmp_path, capsys):
    ck = copy_fixture("zero3_w3_fp32", tmp_path)
    victim = os.path.join(ck, "global_step2", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    os.unlink(victim)
    for args in (["inspect", ck], ["diff", ck, ck], ["export", ck, "emb.weight", "--out",
                                                     str(tmp_path / "e.pt")]):
        rc, out, err = run_cli(args, capsys)
        assert_one_line_error(rc, err, victim, "missing rank file")


def test_deepspeed_truncated_rank_file(tmp_path, capsys):
    ck = copy_fixture("zero2_w3_fp32", tmp_path)
    victim = os.path.join(ck, "global_step2", "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    os.truncate(victim, os.path.getsize(victim) // 2)
    rc, out, err = run_cli(["inspect", ck], capsys)
    assert_one_line_error(rc, err, victim)


class SystemCall:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_runs_no_code(tmp_path, capsys):
    ck = copy_fixture("zero3_w3_fp32", tmp_path)
    marker = tmp_path / "pwned"
    evil = os.path.join(ck, "global_step2", "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    torch.save({"optimizer_state_dict": {"zero_stage": 3, "x": SystemCall(str(marker))}}, evil)
    for args in (["inspect", ck, "--stats"], ["diff", ck, ck]):
        rc, out, err = run_cli(args, capsys)
        assert_one_line_error(rc, err, evil, "refusing to load")
        assert not marker.exists()


def test_malicious_pickle_in_the_first_rank_file(tmp_path, capsys):
    ck = copy_fixture("zero2_w3_fp32", tmp_path)
    marker = tmp_path / "pwned"
    evil = os.path.join(ck, "global_step2", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save({"optimizer_state_dict": SystemCall(str(marker))}, evil)
    rc, out, err = run_cli(["inspect", ck], capsys)
    assert_one_line_error(rc, err, evil, "posix.system")
    assert not marker.exists()


def test_corrupt_safetensors(tmp_path, capsys):
    src = os.path.join(FIXTURES, "zero2_w3_fp32", "expected_zero_to_fp32.safetensors")
    data = open(src, "rb").read()
    bad_json = tmp_path / "bad_json.safetensors"
    bad_json.write_bytes(data[:8] + b"{{" + data[10:])
    rc, out, err = run_cli(["inspect", bad_json], capsys)
    assert_one_line_error(rc, err, str(bad_json), "not valid JSON")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[:-100])
    rc, out, err = run_cli(["inspect", truncated], capsys)
    assert_one_line_error(rc, err, str(truncated), "truncated")
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    rc, out, err = run_cli(["inspect", huge], capsys)
    assert_one_line_error(rc, err, str(huge), "header length")


def test_broken_index(tmp_path, capsys):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{\"weight_map\": ")
    rc, out, err = run_cli(["inspect", index], capsys)
    assert_one_line_error(rc, err, str(index), "not valid JSON")
    index.write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    rc, out, err = run_cli(["inspect", index], capsys)
    assert_one_line_error(rc, err, "model-00001-of-00002.safetensors", "missing")


def test_unknown_tensor_and_state(ckpt, tmp_path, capsys):
    rc, out, err = run_cli(["export", ckpt, "nope", "--out", tmp_path / "x.pt"], capsys)
    assert_one_line_error(rc, err, "no tensor named 'nope'")
    rc, out, err = run_cli(["export", ckpt, "scalar", "--state", "master", "--out",
                            tmp_path / "x.pt"], capsys)
    assert_one_line_error(rc, err, "has no state 'master'")
    rc, out, err = run_cli(["export", ckpt, "scalar", "--out", tmp_path / "x.txt"], capsys)
    assert_one_line_error(rc, err, "unknown output format")


@pytest.mark.parametrize("damage,needle", [
    (lambda sh: sh["states"]["exp_avg"].update(array="rank9/x"), "'rank9/x' is not in 'arrays'"),
    (lambda sh: sh["states"]["exp_avg"].update(offset=-1), "offset must be an integer >= 0"),
    (lambda sh: sh["states"]["exp_avg"].update(offset=10**9), "run past the"),
    (lambda sh: sh.pop("row_start"), "a shard has no 'row_start'"),
    (lambda sh: sh.update(numel=7), "is not rows"),
    (lambda sh: sh.update(rank=9), "world_size is 4"),
])
def test_malformed_manifest_entries(ckpt, capsys, damage, needle):
    from offload_engine.layout import read_group, write_group_attributes
    g = gen_dir(ckpt)
    attrs = read_group(g)
    damage(attrs["tensors"]["emb.weight"]["shards"][1])
    write_group_attributes(g, attrs)
    rc, out, err = run_cli(["inspect", ckpt], capsys)
    assert_one_line_error(rc, err, "emb.weight", needle)
