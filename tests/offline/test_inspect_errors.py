"""Corrupt, incomplete or hostile input to inspect / diff / export: one line on stderr, exit
code 2, no traceback, nothing executed, no partial output file."""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import torch

from helpers.synthetic import reseal
from helpers.inspect_fixtures import (FIXTURES, assert_one_line_error, copy_fixture,
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
    assert_one_line_error(rc, err, chunk, "checksum mismatch")
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


@pytest.mark.parametrize("target", ["group", "array", "rank"])
def test_broken_json(ckpt, capsys, target):
    """The group's zarr.json breaks listing; an array's or a rank's shard table only what
    reads data (listing never opens them)."""
    where = {"group": gen_dir(ckpt), "array": os.path.join(gen_dir(ckpt), "rank2", "exp_avg"),
             "rank": os.path.join(gen_dir(ckpt), "rank2")}[target]
    path = os.path.join(where, "zarr.json")
    text = open(path).read()
    with open(path, "w") as f:
        f.write(text[: len(text) // 2])
    if target != "group":
        reseal(gen_dir(ckpt))  # its checksum would stop it first: the parser is tested here
        rc, out, err = run_cli(["inspect", ckpt], capsys)
        assert rc == 0, err
    rc, out, err = run_cli(["inspect", ckpt] + (["--stats"] if target != "group" else []), capsys)
    assert_one_line_error(rc, err, path, "not valid JSON")


def test_listing_reads_only_the_tensor_table(ckpt, capsys, monkeypatch):
    """Listing opens ``latest`` and the group's zarr.json, no other file (the rest is only
    stat-ed)."""
    import builtins
    opened = []
    real_open = builtins.open

    def spy(file, *a, **k):
        opened.append(os.fspath(file))
        return real_open(file, *a, **k)
    monkeypatch.setattr(builtins, "open", spy)
    rc, out, err = run_cli(["inspect", ckpt, "--json"], capsys)
    monkeypatch.undo()
    assert rc == 0, err
    under = [f for f in opened if f.startswith(ckpt)]
    assert under == [os.path.join(ckpt, "latest"),
                     os.path.join(ckpt, "step-00000007", "zarr.json")], under
    files = json.loads(out)["summary"]["files"]
    assert [os.path.relpath(f["path"], gen_dir(ckpt)) for f in files] == [
        "zarr.json"] + [f"rank{r}/zarr.json" for r in range(4)]


def test_missing_rank(ckpt, capsys):
    shutil.rmtree(os.path.join(gen_dir(ckpt), "rank3"))
    rc, out, err = run_cli(["inspect", ckpt], capsys)
    assert_one_line_error(rc, err, "rank3", "missing")


def rank_table(root: str, rank: int):
    """(path of rank ``rank``'s group, its shard table) in the checkpoint at ``root``."""
    from offload_engine.layout.manifest import read_shard_table
    return os.path.join(gen_dir(root), f"rank{rank}"), read_shard_table(gen_dir(root), rank)


def test_manifest_missing_a_shard(ckpt, capsys):
    from offload_engine.layout.manifest import write_shard_table
    _, table = rank_table(ckpt, 2)
    del table["layers.0.attn.wq.weight"]
    write_shard_table(gen_dir(ckpt), 2, table)
    reseal(gen_dir(ckpt))  # checksums recorded for the damage, as a forger would
    rc, out, err = run_cli(["inspect", ckpt], capsys)
    assert rc == 0, err  # listing does not read the shard tables
    rc, out, err = run_cli(["inspect", ckpt, "--stats"], capsys)
    assert_one_line_error(rc, err, "layers.0.attn.wq.weight", "rows [24, 36) are in no shard")


def test_uncommitted_generation(ckpt, capsys):
    from offload_engine.layout import read_group, write_group_attributes
    g = gen_dir(ckpt)
    attrs = read_group(g)
    attrs["committed"] = False
    write_group_attributes(g, attrs)
    reseal(g)
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
    (lambda sh: sh["states"]["exp_avg"].update(array="rank1/param_bfloat16"), "holds bfloat16"),
    (lambda sh: sh["states"].pop("exp_avg"), "['exp_avg'] of the tensor table are missing"),
    (lambda sh: sh.pop("row_start"), "a shard has no 'row_start'"),
    (lambda sh: sh.update(numel=7), "is not rows"),
    (lambda sh: sh.update(rows=9, numel=9 * 16), "rank 1 holds 9 rows, the tensor table says 10"),
])
def test_malformed_shard_entries(ckpt, capsys, damage, needle):
    """Damage rank 1's shard of emb.weight: what reads data names the rank's table."""
    from offload_engine.layout.manifest import write_shard_table
    group, table = rank_table(ckpt, 1)
    damage(table["emb.weight"])
    write_shard_table(gen_dir(ckpt), 1, table)
    reseal(gen_dir(ckpt))  # checksums recorded for the damage, as a forger would
    rc, out, err = run_cli(["inspect", ckpt, "--stats"], capsys)
    assert_one_line_error(rc, err, os.path.join(group, "zarr.json"), "emb.weight", needle)


@pytest.mark.parametrize("damage,needle", [
    (lambda e: e.update(states=["param"]), "has no 'states' object"),
    (lambda e: e["states"].update(exp_avg="complex64"), "unknown dtype 'complex64'"),
    (lambda e: e.update(shape=[37.5, 16]), "'shape' must be a list of integers"),
    (lambda e: e.update(rows_per_rank=[37, 0, 0]), "'rows_per_rank' must list the rows"),
    (lambda e: e.update(rows_per_rank=[10, 10, 10, 6]), "adding up to 37"),
])
def test_malformed_tensor_table(ckpt, capsys, damage, needle):
    from offload_engine.layout import read_group, write_group_attributes
    g = gen_dir(ckpt)
    attrs = read_group(g)
    damage(attrs["tensors"]["emb.weight"])
    write_group_attributes(g, attrs)
    reseal(g)
    rc, out, err = run_cli(["inspect", ckpt], capsys)
    assert_one_line_error(rc, err, os.path.join(g, "zarr.json"), "emb.weight", needle)


def test_chunks_recorded_absent(tmp_path, capsys):
    """States given as dtypes are never written: their chunk files are absent, recorded as
    null, read as zeros; a chunk file that appears later is an error naming it."""
    from helpers.synthetic import write_checkpoint
    from offload_engine.layout import read_group
    tensors = {"w": {"shape": [128, 32], "dtype": torch.float32, "optimizer": "muon",
                     "states": {"param": torch.ones(128, 32), "momentum_buffer": torch.float32}}}
    gen = write_checkpoint(str(tmp_path), tensors, 2, 3, chunk_bytes=4096)
    crcs = read_group(gen)["checksums"]
    assert crcs["rank0/momentum_buffer"] == [None, None] and None not in crcs["rank0/param"]
    rc, out, err = run_cli(["inspect", tmp_path, "--stats", "--json"], capsys)
    assert rc == 0, err
    stats = {(s["name"], s["state"]): s for s in json.loads(out)["stats"]}
    assert stats[("w", "momentum_buffer")]["zero_fraction"] == 1.0
    chunk = os.path.join(gen, "rank1", "momentum_buffer", "c", "1")
    os.makedirs(os.path.dirname(chunk), exist_ok=True)
    with open(chunk, "wb") as f:
        f.write(bytes(4096))
    for args in (["inspect", tmp_path, "--stats"],
                 ["export", tmp_path, "w", "--state", "momentum_buffer", "--out",
                  tmp_path / "m.npy"]):
        rc, out, err = run_cli(args, capsys)
        assert_one_line_error(rc, err, chunk, "records it as absent")
