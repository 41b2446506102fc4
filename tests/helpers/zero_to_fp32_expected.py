"""The DeepSpeed checkpoints of tests/fixtures/deepspeed (and the GPT-2 one) with what
DeepSpeed's own zero_to_fp32 gave for each, and the bitwise comparison the Python API
tests use."""

import os

import torch
from safetensors.torch import load_file

from helpers import paths
from helpers.consolidate_outputs import bits
from helpers.paths import DEEPSPEED_FIXTURES

DS = DEEPSPEED_FIXTURES
FIXTURES = sorted(os.path.join(DS, d) for d in os.listdir(DS) if os.path.isdir(os.path.join(DS, d)))
FIXTURES.append(os.path.join(paths.FIXTURES, "deepspeed_hf", "gpt2_zero3_w2_tied"))
# DeepSpeed's zero_to_fp32 drops a ZeRO-1 run's frozen parameters (it has no
# frozen_param_shapes there); we keep them (test_consolidate.test_zero1_keeps_frozen...).
ZERO1_FROZEN = {"frozen.weight", "frozen.bias"}
TIES = {"gpt2_zero3_w2_tied": ("lm_head.weight", "transformer.wte.weight")}


def expected(fixture):
    """DeepSpeed's zero_to_fp32 output for ``fixture``: ``{name: tensor}``."""
    return load_file(os.path.join(fixture, "expected_zero_to_fp32.safetensors"))


def tie_of(fixture):
    """``(alias, owner)``: the fixture's tied pair."""
    return TIES.get(os.path.basename(fixture), ("head.weight", "emb.weight"))


def assert_bitwise(got, want):
    """``got`` holds every tensor of ``want`` with its dtype, shape and bits (and at most
    the ZeRO-1 frozen parameters DeepSpeed leaves out besides)."""
    assert set(want) <= set(got) and set(got) - set(want) <= ZERO1_FROZEN, set(got) ^ set(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(bits(g), bits(w)), name
