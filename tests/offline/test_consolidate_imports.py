"""Consolidating a DeepSpeed checkpoint to fp32 runs without torch or ml_dtypes (their
imports take longer than the whole consolidation of a 267M-parameter checkpoint); a
rounding cast still goes through torch, bit for bit as ``Tensor.to``."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from offload_engine.dtypes import BFLOAT16, FLOAT16, FLOAT32
from offload_engine.io import as_byte_view
from offload_engine.offline.casts import cast_into

from helpers.consolidate_outputs import assert_matches_expected
from helpers.deepspeed_checkpoints import ALL, FIXTURES
from helpers.paths import ROOT


# Runs in a fresh interpreter: consolidates each fixture given, then says which of the heavy
# modules the run imported.
CONSOLIDATE = """
import json, sys
from offload_engine.cli.main import main
out, dtype, fixtures = sys.argv[1], sys.argv[2], sys.argv[3:]
rcs = [main(["consolidate", f, f"{out}/{i}", "--dtype", dtype]) for i, f in enumerate(fixtures)]
print(json.dumps({"rcs": rcs, "torch": "torch" in sys.modules, "zarr": "zarr" in sys.modules,
                  "ml_dtypes": "ml_dtypes" in sys.modules}))
"""


def consolidate_in_fresh_process(out, dtype, fixtures) -> dict:
    proc = subprocess.run([sys.executable, "-c", CONSOLIDATE, str(out), dtype, *fixtures],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.multiprocess
def test_fp32_consolidation_imports_neither_torch_nor_zarr(tmp_path):
    fixtures = [os.path.join(FIXTURES, f) for f in ALL]  # fp32 and bf16 runs (bf16 frozen weights)
    seen = consolidate_in_fresh_process(tmp_path, "fp32", fixtures)
    assert seen["rcs"] == [0] * len(fixtures)
    assert not seen["torch"], "consolidate --dtype fp32 imported torch"
    assert not seen["zarr"], "consolidate --dtype fp32 imported zarr"
    assert not seen["ml_dtypes"], "consolidate --dtype fp32 imported ml_dtypes"
    for i, fixture in enumerate(fixtures):
        assert_matches_expected(tmp_path / str(i), os.path.join(fixture, "expected_zero_to_fp32.safetensors"))


@pytest.mark.multiprocess
def test_bf16_output_imports_torch_for_the_cast(tmp_path):
    fixture = os.path.join(FIXTURES, "zero3_w3_fp32")
    seen = consolidate_in_fresh_process(tmp_path, "bf16", [fixture])
    assert seen["rcs"] == [0] and seen["torch"]
    assert_matches_expected(tmp_path / "0", os.path.join(fixture, "expected_zero_to_fp32.safetensors"),
                            cast=torch.bfloat16)


def every_16_bit_pattern() -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


@pytest.mark.parametrize("src_dtype,torch_dtype", [(BFLOAT16, torch.bfloat16), (FLOAT16, torch.float16)])
def test_widening_casts_match_torch_on_every_bit_pattern(src_dtype, torch_dtype):
    """bfloat16 -> float32 runs in numpy, float16 -> float32 in torch (torch quiets signalling
    NaNs, numpy does not): both must give torch's bits for all 65536 inputs, NaNs included."""
    src = every_16_bit_pattern()
    got = np.empty(src.size, np.uint32)
    cast_into(got, FLOAT32, src, src_dtype)
    want = torch.from_numpy(src.view(np.int16).copy()).view(torch_dtype).to(torch.float32)
    assert np.array_equal(got.view(np.uint32), want.view(torch.int32).numpy().view(np.uint32))


def test_narrowing_cast_rounds_as_torch():
    g = torch.Generator().manual_seed(0)
    values = torch.cat([torch.randn(100_000, generator=g) * 1e3,
                        torch.tensor([float("nan"), float("inf"), -0.0, 3.4e38, 1e-40])])
    for dtype, torch_dtype in ((BFLOAT16, torch.bfloat16), (FLOAT16, torch.float16)):
        got = np.empty(values.numel(), np.uint16)
        cast_into(got, dtype, values.numpy(), FLOAT32)
        want = values.to(torch_dtype).view(torch.int16).numpy()
        assert np.array_equal(got.view(np.int16), want)


def test_byte_view_of_a_bfloat16_array():
    """numpy cannot export ml_dtypes' bfloat16 through the buffer protocol; the byte view can."""
    a = np.zeros(5, BFLOAT16.numpy)
    view = as_byte_view(a)
    assert len(view) == 10 and not view.readonly
    view[:2] = b"\x80\x3f"  # 1.0 in bfloat16, little endian
    assert float(a[0]) == 1.0


POOL_WITHOUT_TORCH = """
import sys
from offload_engine.io import BufferPool
with BufferPool(1 << 16) as pool, pool.acquire(100) as buf:
    buf.memoryview()[:3] = b"abc"
    address = buf.data_ptr()
    before = "torch" in sys.modules
    t = buf.bytes  # a torch view imports torch, over the same memory
    assert t.data_ptr() == address and bytes(t[:3].numpy()) == b"abc", (t.data_ptr(), address)
    assert buf.view(__import__("torch").float32).numel() == 25
print(before, pool.pinned == __import__("torch").cuda.is_available())
"""


@pytest.mark.multiprocess
def test_buffer_pool_imports_torch_only_for_torch_views():
    proc = subprocess.run([sys.executable, "-c", POOL_WITHOUT_TORCH], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True"]  # torch not imported before; pinned as with torch
