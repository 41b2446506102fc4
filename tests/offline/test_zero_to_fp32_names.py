"""DeepSpeed's zero_to_fp32 function names, keywords, return types and file names, served by
offload_engine.consolidate for DeepSpeed's checkpoints (every fixture, against DeepSpeed's own
output) and for ours. The script-level proof (a DeepSpeed user's script with its import line
changed) is tests/integration/test_zero_to_fp32_dropin.py."""

import gc
import json
import os

import pytest
import torch
from safetensors import safe_open
from torch import nn

import offload_engine.consolidate as dropin
from offload_engine.consolidate import (LazyTensor, convert_zero_checkpoint_to_fp32_state_dict,
                                        convert_zero_checkpoint_to_state_dict,
                                        get_fp32_state_dict,
                                        get_fp32_state_dict_from_zero_checkpoint,
                                        load_state_dict_from_zero_checkpoint, to_torch_tensor)
from offload_engine.errors import InputError, UsageError

from helpers.synthetic import write_checkpoint
from helpers.zero_to_fp32_expected import (DS, FIXTURES, ZERO1_FROZEN, assert_bitwise,
                                           expected, tie_of)

ZERO3 = os.path.join(DS, "zero3_w3_fp32")


def test_deepspeeds_signatures_are_ours():
    """Every parameter name, order and default of DeepSpeed 0.19.8's public functions."""
    import inspect

    want = {
        "get_fp32_state_dict_from_zero_checkpoint":
            "(checkpoint_dir, tag=None, exclude_frozen_parameters=False, lazy_mode=False)",
        "convert_zero_checkpoint_to_fp32_state_dict":
            "(checkpoint_dir, output_dir, max_shard_size='5GB', safe_serialization=False, "
            "tag=None, exclude_frozen_parameters=False)",
        "convert_zero_checkpoint_to_state_dict":
            "(checkpoint_dir, output_dir, dtype='float32', max_shard_size='5GB', "
            "safe_serialization=False, tag=None, exclude_frozen_parameters=False)",
        "load_state_dict_from_zero_checkpoint": "(model, checkpoint_dir, tag=None)",
        "to_torch_tensor": "(state_dict, return_empty_tensor=False, dtype=None)",
    }
    for name, signature in want.items():
        params = inspect.signature(getattr(dropin, name)).parameters.values()
        got = "(" + ", ".join(p.name if p.default is p.empty else f"{p.name}={p.default!r}"
                              for p in params) + ")"
        assert got == signature, name


@pytest.mark.parametrize("fixture", FIXTURES, ids=os.path.basename)
def test_state_dict_equals_deepspeed(fixture):
    got = get_fp32_state_dict_from_zero_checkpoint(fixture)
    assert type(got) is dict  # DeepSpeed 0.19.8 returns a plain dict
    assert_bitwise(got, expected(fixture))
    alias, owner = tie_of(fixture)
    assert got[alias] is got[owner]
    assert all(t.device.type == "cpu" for t in got.values())
    # DeepSpeed's values are its fp32 masters: trainable ones require grad, others not
    assert got[owner].requires_grad and not got.get("offs", torch.zeros(1)).requires_grad


@pytest.mark.parametrize("fixture", FIXTURES, ids=os.path.basename)
def test_lazy_mode_gives_objects_read_on_contiguous(fixture):
    lazy = get_fp32_state_dict_from_zero_checkpoint(fixture, lazy_mode=True)
    eager = get_fp32_state_dict_from_zero_checkpoint(fixture)
    assert list(lazy) == list(eager)
    alias, owner = tie_of(fixture)
    assert lazy[alias] is lazy[owner]  # DeepSpeed's to_torch_tensor finds ties by identity
    got = {}
    for name, lazy_tensor in lazy.items():
        assert isinstance(lazy_tensor, LazyTensor)
        assert lazy_tensor.shape == eager[name].shape and lazy_tensor.dtype == eager[name].dtype
        got[name] = lazy_tensor.contiguous()
    assert lazy[owner].contiguous() is not got[owner]  # read again, not kept
    assert_bitwise(got, expected(fixture))


def test_to_torch_tensor_materialises_a_lazy_state_dict_as_deepspeeds_helper():
    lazy = get_fp32_state_dict_from_zero_checkpoint(ZERO3, lazy_mode=True)
    got = to_torch_tensor(lazy)
    assert_bitwise(got, expected(ZERO3))
    assert got["head.weight"] is got["emb.weight"]
    half = to_torch_tensor(lazy, dtype="bf16")
    assert half["l1.weight"].dtype == torch.bfloat16 and half["offs"].dtype == torch.int64
    empty = to_torch_tensor(lazy, return_empty_tensor=True, dtype=torch.float16)
    assert empty["l1.weight"].shape == (13, 16) and empty["l1.weight"].dtype == torch.float16


def test_lazy_mode_keeps_the_checkpoint_open_until_the_last_tensor_goes(monkeypatch):
    from offload_engine.formats.deepspeed import DeepSpeedSource

    closed = []
    real_close = DeepSpeedSource.close
    monkeypatch.setattr(DeepSpeedSource, "close", lambda self: (closed.append(1), real_close(self)))
    lazy = get_fp32_state_dict_from_zero_checkpoint(ZERO3, lazy_mode=True)
    one = lazy["l1.weight"]
    del lazy
    gc.collect()
    assert not closed and one.contiguous().shape == (13, 16)
    del one
    gc.collect()
    assert closed


def test_deepspeed_keywords_on_our_own_function():
    """get_fp32_state_dict(ckpt, exclude_frozen_parameters=True) was a TypeError."""
    got = get_fp32_state_dict(ZERO3, exclude_frozen_parameters=True)
    assert not ZERO1_FROZEN & set(got) and "offs" in got
    with get_fp32_state_dict(ZERO3, tag="global_step2", lazy_mode=True) as lazy:
        assert list(lazy) == list(get_fp32_state_dict(ZERO3))
    with pytest.raises(UsageError):
        get_fp32_state_dict(ZERO3, exclude_frozen=True, exclude_frozen_parameters=False)


def test_exclude_frozen_and_tag_as_deepspeed():
    got = get_fp32_state_dict_from_zero_checkpoint(ZERO3, "global_step2", True)
    assert not ZERO1_FROZEN & set(got) and {"offs", "l1.weight", "head.weight"} <= set(got)
    with pytest.raises(InputError):
        get_fp32_state_dict_from_zero_checkpoint(ZERO3, tag="global_step9")


@pytest.mark.parametrize("fixture", [FIXTURES[-1], ZERO3], ids=os.path.basename)
def test_convert_writes_deepspeeds_file_names(tmp_path, fixture):
    want = expected(fixture)
    alias, owner = tie_of(fixture)
    convert_zero_checkpoint_to_fp32_state_dict(fixture, str(tmp_path / "bin"))
    assert os.listdir(tmp_path / "bin") == ["pytorch_model.bin"]
    got = torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)
    assert_bitwise(got, want)
    assert got[alias].data_ptr() == got[owner].data_ptr()  # stored once, tied on load

    convert_zero_checkpoint_to_fp32_state_dict(fixture, str(tmp_path / "sharded"),
                                               max_shard_size="1KB")
    names = sorted(os.listdir(tmp_path / "sharded"))
    shards = [n for n in names if n.endswith(".bin")]
    assert names == shards + ["pytorch_model.bin.index.json"]
    assert shards == [f"pytorch_model-{i:05d}-of-{len(shards):05d}.bin"
                      for i in range(1, len(shards) + 1)]
    with open(tmp_path / "sharded" / "pytorch_model.bin.index.json") as f:
        index = json.load(f)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * 4 if t.is_floating_point() else t.nbytes for n, t in want.items() if n != alias)
    assert index["weight_map"][alias] == index["weight_map"][owner]
    merged = {}
    for shard in shards:
        merged.update(torch.load(tmp_path / "sharded" / shard, weights_only=True))
    assert_bitwise(merged, want)

    convert_zero_checkpoint_to_fp32_state_dict(fixture, str(tmp_path / "st"),
                                               safe_serialization=True, max_shard_size=None)
    assert os.listdir(tmp_path / "st") == ["model.safetensors"]
    with safe_open(str(tmp_path / "st" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt", alias: owner}  # DeepSpeed raised here
        got = {k: f.get_tensor(k) for k in f.keys()}
    got[alias] = got[owner]
    assert_bitwise(got, want)


def test_convert_to_half_precision_keeps_integer_buffers(tmp_path):
    convert_zero_checkpoint_to_state_dict(ZERO3, str(tmp_path), dtype=torch.bfloat16)
    got = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    want = expected(ZERO3)
    assert got["l1.weight"].dtype == torch.bfloat16
    assert torch.equal(got["l1.weight"], want["l1.weight"].to(torch.bfloat16))
    assert got["offs"].dtype == torch.int64 and got["offs"].item() == 16777217
    with pytest.raises(InputError, match="float64"):
        convert_zero_checkpoint_to_state_dict(ZERO3, str(tmp_path), dtype="float64")


def test_load_into_the_model_returns_it_on_cpu_non_strict():
    fixture = os.path.join(DS, "zero2_w3_fp32")
    want = expected(fixture)
    model = nn.Module()
    model.l1 = nn.Linear(16, 13)
    model.extra = nn.Linear(2, 2)  # not in the checkpoint: left alone, as DeepSpeed does
    before = model.extra.weight.detach().clone()
    assert load_state_dict_from_zero_checkpoint(model, fixture, tag="global_step2") is model
    assert torch.equal(model.l1.weight.detach(), want["l1.weight"])
    assert torch.equal(model.extra.weight.detach(), before)


def test_our_checkpoints_under_deepspeeds_names(tmp_path):
    gen = torch.Generator().manual_seed(0)
    weights = {"a.weight": torch.randn(7, 5, generator=gen),
               "b.weight": torch.randn(9, generator=gen).to(torch.bfloat16)}
    tensors = {name: {"shape": list(v.shape), "dtype": v.dtype, "optimizer": "adamw",
                      "states": {"param": v}} for name, v in weights.items()}
    write_checkpoint(str(tmp_path / "ck"), tensors, world_size=2, step=3)
    got = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ck"))
    assert list(got) == list(weights) and got["b.weight"].dtype == torch.float32
    assert torch.equal(got["a.weight"], weights["a.weight"])
    lazy = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ck"), lazy_mode=True)
    assert torch.equal(lazy["b.weight"].contiguous(), weights["b.weight"].float())
    convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ck"), str(tmp_path / "out"))
    saved = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert torch.equal(saved["a.weight"], weights["a.weight"])


def test_an_unwritable_output_file_is_an_io_error_naming_it(tmp_path):
    """torch.save alone says "open file failed with strerror: Is a directory", no path."""
    from offload_engine.io.errors import FileIOError

    (tmp_path / "pytorch_model.bin").mkdir()
    with pytest.raises(FileIOError, match=r"pytorch_model\.bin.*Is a directory"):
        convert_zero_checkpoint_to_fp32_state_dict(ZERO3, str(tmp_path))
