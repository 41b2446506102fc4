"""Streaming consolidation to Hugging Face safetensors, checked against DeepSpeed's own output."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from offload_engine.cli.main import main
from offload_engine.dtypes import BFLOAT16, FLOAT32, dtype as as_dtype
from offload_engine.formats import TensorMeta
from offload_engine.formats.deepspeed import DeepSpeedSource
from offload_engine.offline.consolidate import consolidate, output_dtype, verify_output
from offload_engine.offline.hf_shards import OutTensor, parse_size, plan_files, split_shards

from helpers.consolidate_outputs import DictSource, assert_matches_expected, bits, load_output
from helpers.deepspeed_checkpoints import ALL, FIXTURES


# -- against DeepSpeed's zero_to_fp32 ---------------------------------------------------------------

@pytest.mark.parametrize("fixture", ALL)
def test_fixture_matches_zero_to_fp32(tmp_path, fixture, capsys):
    src = os.path.join(FIXTURES, fixture)
    out = tmp_path / "out"
    assert main(["consolidate", src, str(out)]) == 0
    assert os.listdir(out) == ["model.safetensors"]
    got, aliases = assert_matches_expected(out, os.path.join(src, "expected_zero_to_fp32.safetensors"))
    assert aliases == {"head.weight": "emb.weight"}
    assert "head.weight" not in got  # written once
    assert got["offs"].dtype == torch.int64 and got["offs"].tolist() == [16777217]
    assert "frozen.weight" in got


@pytest.mark.parametrize("zero1,reference", [("zero1_w2_fp32", "zero3_w2_fp32"), ("zero1_w4_bf16", "zero2_w4_bf16")])
def test_zero1_keeps_frozen_parameters(tmp_path, zero1, reference):
    """zero_to_fp32 drops frozen parameters of ZeRO-1 checkpoints (no frozen_param_shapes);
    we take them from the module state dict. Same seed, same model: they must equal what
    DeepSpeed exported for the frozen layer of the ZeRO-2/3 run of the same model."""
    out = tmp_path / "out"
    with DeepSpeedSource(os.path.join(FIXTURES, zero1)) as s:
        assert {i.name: i.kind for i in s.tensors()}["frozen.weight"] == "frozen"
        consolidate(s, str(out))
    got, _ = load_output(out)
    ref = load_file(os.path.join(FIXTURES, reference, "expected_zero_to_fp32.safetensors"))
    assert "frozen.weight" not in load_file(os.path.join(FIXTURES, zero1, "expected_zero_to_fp32.safetensors"))
    for name in ("frozen.weight", "frozen.bias"):
        assert torch.equal(bits(got[name]), bits(ref[name])), name


@pytest.mark.parametrize("fixture", ALL)
def test_sharded_output_is_a_valid_hf_index(tmp_path, fixture, capsys):
    src = os.path.join(FIXTURES, fixture)
    out = tmp_path / "out"
    assert main(["consolidate", src, str(out), "--max-shard-size", "1KB", "--verify"]) == 0
    index = json.load(open(out / "model.safetensors.index.json"))
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    n = len(files)
    assert n > 1 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert list(index["weight_map"]) == sorted(index["weight_map"])
    assert set(index["weight_map"].values()) == set(files)
    total = 0
    for name, fname in index["weight_map"].items():
        with safe_open(out / fname, framework="pt") as f:
            assert name in f.keys()
            total += f.get_tensor(name).numel() * f.get_tensor(name).element_size()
    assert index["metadata"]["total_size"] == total
    assert index["metadata"]["head.weight"] == "emb.weight"
    assert_matches_expected(out, os.path.join(src, "expected_zero_to_fp32.safetensors"))


def test_shards_follow_hf_greedy_split(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["consolidate", os.path.join(FIXTURES, "zero3_w3_fp32"), str(out), "--max-shard-size", "1KB"]) == 0
    wm = json.load(open(out / "model.safetensors.index.json"))["weight_map"]
    shard = {k: int(v[6:11]) for k, v in wm.items()}
    # key order: offs(8 B) frozen.weight(448) frozen.bias(28) emb.weight(2368 > 1000: own shard,
    # placed first) l1.weight(832) l1.bias(52) l2.weight(832) l2.bias(64)
    assert shard == {"emb.weight": 1, "offs": 2, "frozen.weight": 2, "frozen.bias": 2,
                     "l1.weight": 3, "l1.bias": 3, "l2.weight": 4, "l2.bias": 4}


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_dtype_casts_floats_only(tmp_path, dtype, torch_dtype, capsys):
    src = os.path.join(FIXTURES, "zero2_w3_fp32")
    out = tmp_path / "out"
    assert main(["consolidate", src, str(out), "--dtype", dtype, "--verify"]) == 0
    got, _ = assert_matches_expected(out, os.path.join(src, "expected_zero_to_fp32.safetensors"), cast=torch_dtype)
    assert got["offs"].dtype == torch.int64 and got["offs"].tolist() == [16777217]
    assert {t.dtype for n, t in got.items() if n != "offs"} == {torch_dtype}


def test_exclude_frozen(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["consolidate", os.path.join(FIXTURES, "zero3_w3_fp32"), str(out), "--exclude-frozen", "--verify"]) == 0
    got, aliases = load_output(out)
    assert not any(n.startswith("frozen.") for n in got)
    assert {"emb.weight", "l1.weight", "offs"} <= set(got) and aliases == {"head.weight": "emb.weight"}


def test_tiny_windows_split_tensors_and_casts(tmp_path):
    """Windows far smaller than a tensor: every tensor crosses windows, casts go through staging."""
    src = os.path.join(FIXTURES, "zero3_w3_fp32")
    for dtype, window in ((torch.float32, 64), (torch.bfloat16, 72)):
        out = tmp_path / f"out{window}"
        with DeepSpeedSource(src) as s:
            consolidate(s, str(out), dtype=dtype, window_bytes=window, max_shard_bytes=2000)
            assert verify_output(s, str(out), dtype=dtype, chunk_bytes=100) == []
        assert_matches_expected(out, os.path.join(src, "expected_zero_to_fp32.safetensors"), cast=dtype)


def test_verify_finds_a_flipped_byte(tmp_path, capsys):
    src = os.path.join(FIXTURES, "zero2_w3_fp32")
    out = tmp_path / "out"
    assert main(["consolidate", src, str(out)]) == 0
    path = out / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # inside the last tensor's data
    path.write_bytes(bytes(data))
    with DeepSpeedSource(src) as s:
        problems = verify_output(s, str(out))
    assert len(problems) == 1 and "differs" in problems[0]


def test_rerun_replaces_stale_shards(tmp_path, capsys):
    src = os.path.join(FIXTURES, "zero2_w3_fp32")
    out = tmp_path / "out"
    assert main(["consolidate", src, str(out), "--max-shard-size", "1KB"]) == 0
    (out / "config.json").write_text("{}")
    assert main(["consolidate", src, str(out)]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


def test_stale_temporary_folder_is_removed(tmp_path, capsys):
    out = tmp_path / "out"
    stale = out / ".consolidate-tmp-999999999"  # no such process
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    assert main(["consolidate", os.path.join(FIXTURES, "zero2_w3_fp32"), str(out)]) == 0
    assert os.listdir(out) == ["model.safetensors"]


def test_bad_options(tmp_path, capsys):
    src = os.path.join(FIXTURES, "zero2_w3_fp32")
    assert main(["consolidate", src, str(tmp_path / "o"), "--max-shard-size", "lots"]) == 2
    assert "not a size" in capsys.readouterr().err


# -- sharding rules ---------------------------------------------------------------------------------

def test_parse_size_decimal_like_hf():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("1GiB") == 2**30
    assert parse_size("1KB") == 1000 and parse_size("4096") == 4096
    for bad in ("0", "-1GB", "5XB", ""):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_split_shards_matches_hf_docstring_example():
    GB = 10**9
    ts = [OutTensor(f"t{i}", (s * GB // 4,), FLOAT32) for i, s in enumerate([6, 6, 2, 6, 2, 2])]
    sizes = [[t.nbytes // GB for t in shard] for shard in split_shards(ts, 10 * GB)]
    assert sizes == [[6], [6, 2], [6, 2, 2]]


def test_oversized_tensor_gets_its_own_shard_first():
    ts = [OutTensor("a", (10,), FLOAT32), OutTensor("big", (1000,), FLOAT32), OutTensor("b", (10,), FLOAT32)]
    assert [[t.name for t in s] for s in split_shards(ts, 100)] == [["big"], ["a", "b"]]


def test_headers_are_padded_and_aligned():
    ts = [OutTensor("h", (3,), BFLOAT16), OutTensor("i", (2,), as_dtype("int64")), OutTensor("f", (1,), FLOAT32)]
    plans, index = plan_files(ts, 10**9, {"tied": "h"})
    (plan,) = plans
    assert index is None and len(plan.header) % 8 == 0
    assert [(s.tensor.name, s.offset) for s in plan.slots] == [("i", 0), ("f", 16), ("h", 20)]
    header = json.loads(plan.header[8:])
    assert header["__metadata__"] == {"format": "pt", "tied": "h"}


# -- the interface, with a source that is not DeepSpeed -------------------------------------------


def test_any_source_plugs_in(tmp_path):
    g = torch.Generator().manual_seed(1)
    data = {
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "mask": torch.tensor([True, False, True]),
        "ids": torch.tensor([2**40 + 1, -7], dtype=torch.int64),
        "half": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "big": torch.randn(300, 7, generator=g),
    }
    src = DictSource(data, {"tied": "big"})
    out = tmp_path / "out"
    result = consolidate(src, str(out), max_shard_bytes=4000, window_bytes=256)
    assert len(result.files) > 2 and result.index is not None
    assert verify_output(src, str(out)) == []
    got, aliases = load_output(out)
    assert aliases == {"tied": "big"}
    for name, t in data.items():
        want = t.to(output_dtype(TensorMeta.single(name, tuple(t.shape), t.dtype), torch.float32).torch)
        assert got[name].dtype == want.dtype and torch.equal(bits(got[name]), bits(want)), name


def test_failed_read_leaves_no_partial_output(tmp_path):
    class Broken(DictSource):
        def read(self, requests):
            raise OSError(5, "simulated read failure")

    out = tmp_path / "out"
    with pytest.raises(OSError, match="simulated"):
        consolidate(Broken({"w": torch.ones(1000)}), str(out), window_bytes=512)
    assert os.listdir(out) == []


def test_memory_is_a_few_windows_not_the_model(tmp_path):
    """A 24 MB model through 256 KiB windows: buffers in use stay at a few windows (four
    slots: two writes, one queued, one filling; a fifth, the staging, for a cast), the
    largest tensor (16 MB) crosses many windows, and a bf16 cast goes through the staging
    buffer."""
    from helpers.deepspeed_checkpoints import write_synthetic

    g = torch.Generator().manual_seed(0)
    params = {"big": torch.randn(2000, 2000, generator=g), "small": torch.randn(7, generator=g),
              "mid": torch.randn(1000, 2000, generator=g)}
    write_synthetic(tmp_path / "ck", 3, 4, params, sub_group_numel=600_000)
    window = 256 * 1024
    for dtype in (torch.float32, torch.bfloat16):
        out = tmp_path / f"out-{dtype}".replace("torch.", "")
        with DeepSpeedSource(str(tmp_path / "ck")) as src:
            result = consolidate(src, str(out), dtype=dtype, window_bytes=window, max_shard_bytes=10**7)
            assert result.peak_buffer_bytes <= (5 if dtype == torch.bfloat16 else 4) * window
            assert verify_output(src, str(out), dtype=dtype, chunk_bytes=window) == []
        got, _ = load_output(out)
        for name, want in params.items():
            assert torch.equal(got[name], want.to(dtype)), name


def test_cli_verify_failure_exits_1(tmp_path, capsys, monkeypatch):
    import offload_engine.cli.consolidate as cli

    monkeypatch.setattr(cli, "verify_output", lambda *a, **k: ["model.safetensors: emb.weight differs"])
    rc = main(["consolidate", os.path.join(FIXTURES, "zero2_w3_fp32"), str(tmp_path / "o"), "--verify"])
    assert rc == 1 and "emb.weight differs" in capsys.readouterr().err


def test_progress_line_ends_with_newline():
    import io

    from offload_engine.cli.progress import ProgressLine

    stream = io.StringIO()
    line = ProgressLine(stream)
    line(5 * 10**8, 10**9)
    line(10**9, 10**9)
    text = stream.getvalue()
    # tqdm's line (cli/progress.py): redrawn in place, the last state complete, then a newline
    last = text.rstrip("\n").split("\r")[-1]
    assert text.startswith("\rconsolidate:") and text.endswith("\n")
    assert last.startswith("consolidate: 100%") and "1.00G/1.00G" in last
