"""A consolidated DeepSpeed checkpoint of a transformers model loads with ``from_pretrained``.

The fixture is a GPT-2 with tied input and output embeddings, trained two steps under
DeepSpeed ZeRO-3 at world size 2 (tests/fixtures/deepspeed_hf/README.md). DeepSpeed records
the tie in ``shared_params``; consolidate writes ``transformer.wte.weight`` once and records
``lm_head.weight`` as its alias, and transformers must re-tie it with nothing missing.
"""

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import GPT2LMHeadModel

from offload_engine.cli.main import main

from helpers.paths import FIXTURES

FIXTURE = os.path.join(FIXTURES, "deepspeed_hf", "gpt2_zero3_w2_tied")


@pytest.mark.parametrize("max_shard", [None, "8KB"])
def test_from_pretrained_loads_the_tied_output(tmp_path, max_shard, capsys):
    out = tmp_path / "out"
    args = ["consolidate", FIXTURE, str(out), "--verify"]
    if max_shard:
        args += ["--max-shard-size", max_shard]
    assert main(args) == 0
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert (len(files) > 1) == bool(max_shard)
    for name in files:  # the tied name is written once, under its owner
        with safe_open(os.path.join(out, name), framework="pt") as f:
            assert "lm_head.weight" not in f.keys()
    shutil.copy(os.path.join(FIXTURE, "config.json"), out)

    model, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)

    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    state = model.state_dict()
    expected = load_file(os.path.join(FIXTURE, "expected_zero_to_fp32.safetensors"))
    assert "lm_head.weight" in expected and set(expected) <= set(state)
    for name, want in expected.items():  # DeepSpeed's own fp32 masters, bit for bit
        assert state[name].dtype == want.dtype and torch.equal(state[name], want), name


@pytest.mark.parametrize("src", ["root", "tag folder"])
def test_config_and_tokenizer_files_come_along(tmp_path, src, capsys):
    """The Trainer saves config.json and tokenizer files beside `latest`: consolidate copies
    them (from SRC, or from above a tag folder given as SRC), so from_pretrained(OUT) loads
    with nothing done by hand; a stale copy in OUT is replaced."""
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(FIXTURE, ckpt)
    (ckpt / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    (ckpt / "notes.txt").write_text("not a model file")
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")  # stale
    arg = str(ckpt if src == "root" else ckpt / "global_step2")
    assert main(["consolidate", arg, str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted(report["copied"]) == ["config.json", "tokenizer_config.json"]
    assert not (out / "notes.txt").exists()
    assert (out / "config.json").read_bytes() == (ckpt / "config.json").read_bytes()
    model, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_no_copy_config(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["consolidate", FIXTURE, str(out), "--no-copy-config"]) == 0
    assert sorted(os.listdir(out)) == ["model.safetensors"]
