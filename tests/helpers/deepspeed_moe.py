"""The DeepSpeed mixture-of-experts fixtures (tests/fixtures/deepspeed_moe/) and what
DeepSpeed itself held when it saved them."""

import os

import torch
from safetensors.torch import load_file

from helpers.paths import FIXTURES

MOE = os.path.join(FIXTURES, "deepspeed_moe")
RUNS = sorted(d for d in os.listdir(MOE) if os.path.isdir(os.path.join(MOE, d)))
# deepspeed.moe.layer.MoE under ZeRO-1/2 (per-expert files); AutoEP under ZeRO-3 (grouped)
NATIVE = [r for r in RUNS if "autoep" not in r]
AUTOEP = [r for r in RUNS if "autoep" in r]
EP2_W4 = os.path.join(MOE, "zero2_ep2_w4_fp32")  # expert-parallel 2 x expert data-parallel 2


def expected(run: str) -> dict[str, dict[str, torch.Tensor]]:
    """{state: {name: tensor}}: DeepSpeed's fp32 masters ("master") and Adam moments at save
    time, under the checkpoint's names (global expert ids)."""
    out: dict[str, dict] = {}
    for key, value in load_file(os.path.join(MOE, run, "expected.safetensors")).items():
        state, name = key.split("/", 1)
        out.setdefault(state, {})[name] = value
    return out
