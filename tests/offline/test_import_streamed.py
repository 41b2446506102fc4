"""``import deepspeed`` streams: the source's bytes go straight into the blocks that are
written, the tables are written as they are produced, and no torch is imported. What a user
relies on: a bf16 model's parameters are the masters rounded exactly as torch rounds them,
the import starts in the time Python takes (no torch), and its memory is flat in the
number of tensors (a mixture-of-experts checkpoint of 100,000 experts fits where one of
100 does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from offload_engine.formats.ours import OursSource
from offload_engine.migrate import from_deepspeed
from offload_engine.offline.narrow_cast import cast_bytes
from offload_engine.dtypes import BFLOAT16, FLOAT32
from helpers import paths
from helpers.paths import ROOT, child_env

FIXTURES = os.path.join(paths.FIXTURES, "deepspeed_import")


def _bit_patterns() -> np.ndarray:
    """Every upper half with low halves at and around the rounding tie (0x7FFF, 0x8000,
    0x8001), at zero and at the top, plus random bits: rounding, carries into the
    exponent, infinities, subnormals, NaNs."""
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    rng = np.random.default_rng(0)
    return np.concatenate([(high[:, None] | lows[None, :]).reshape(-1),
                           rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint32)])


def test_bf16_rounding_is_torchs_bit_for_bit():
    bits = _bit_patterns()
    finite = bits[~np.isnan(bits.view(np.float32))]
    for src in (finite, bits):  # without NaN (numpy) and with (torch's own cast)
        got = np.empty(len(src), dtype=np.uint16)
        cast_bytes(memoryview(got.view(np.uint8)), BFLOAT16, src.view(np.uint8), FLOAT32)
        want = torch.from_numpy(src.view(np.float32)).to(torch.bfloat16).view(torch.int16)
        assert np.array_equal(got, want.numpy().view(np.uint16))


def test_bf16_import_rounds_masters_as_torch(tmp_path):
    """The bf16 run's ``param`` is its fp32 master rounded by torch, read back from the
    imported generation (blocks of 4 KiB: tensors split across blocks and reads)."""
    summary = from_deepspeed(os.path.join(FIXTURES, "zero2_w2_bf16_adamw"), str(tmp_path), 3,
                             window_bytes=100)
    assert summary.param_dtype == "bfloat16"
    with OursSource.open_checkpoint(str(tmp_path)) as src:
        for meta in src.tensors():
            if "master_param" not in meta.states:
                continue
            master = torch.empty(meta.numel, dtype=torch.float32)
            src.read_state(meta.name, "master_param", 0, master)
            param = torch.empty(meta.numel, dtype=torch.bfloat16)
            src.read_state(meta.name, "param", 0, param)
            assert torch.equal(param.view(torch.int16), master.bfloat16().view(torch.int16))


RUN = """
import json, sys
from offload_engine.cli.main import main
rc = main(sys.argv[1:])
print("\\n" + json.dumps({"rc": rc, "torch": "torch" in sys.modules}))
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", ["zero3_w2_fp32_adamw", "zero2_w2_bf16_adamw"])
def test_import_needs_no_torch(tmp_path, run):
    """fp32 and bf16 runs import without torch (seconds of start-up on a slow machine)."""
    proc = subprocess.run([sys.executable, "-c", RUN, "import", "deepspeed",
                           os.path.join(FIXTURES, run), str(tmp_path), "--world-size", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env())
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"rc": 0, "torch": False}
