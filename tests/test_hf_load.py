"""A consolidated DeepSpeed checkpoint of a transformers model loads with ``from_pretrained``.

The fixture is a GPT-2 with tied input and output embeddings, trained two steps under
DeepSpeed ZeRO-3 at world size 2 (tests/fixtures/deepspeed_hf/README.md). DeepSpeed records
the tie in ``shared_params``; consolidate writes ``transformer.wte.weight`` once and records
``lm_head.weight`` as its alias, and transformers must re-tie it with nothing missing.
"""

import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import GPT2LMHeadModel

from offload_engine.cli.main import main

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "deepspeed_hf", "gpt2_zero3_w2_tied")


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
