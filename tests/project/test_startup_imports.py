"""Commands that only look at metadata or move bytes start in about the time Python takes:
they import neither torch nor ml_dtypes (seconds each on a slow machine) unless a tensor of
that kind is touched. Each case runs the real command line in a fresh interpreter and
reports which heavy modules it imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers.synthetic import write_checkpoint
from helpers.inspect_fixtures import FIXTURES
from helpers.paths import ROOT

pytestmark = pytest.mark.multiprocess  # every test runs a fresh interpreter

HEAVY = ("torch", "ml_dtypes", "zarr")

RUN = """
import json, sys
from offload_engine.cli.main import main
rc = main(sys.argv[1:])
sys.stdout.flush()
print("\\n" + json.dumps({"rc": rc, **{m: m in sys.modules for m in %r}}))
""" % (HEAVY,)


def imports_of(*argv) -> dict:
    """Run ``offload-engine ARGV`` in a fresh interpreter: its exit code, and which of the
    heavy modules it imported."""
    proc = subprocess.run([sys.executable, "-c", RUN, *map(str, argv)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def light(seen: dict) -> bool:
    return seen["rc"] == 0 and not any(seen[m] for m in HEAVY)


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    """One of our checkpoints (2 ranks): fp32 and bf16 parameters, fp32 optimizer state."""
    root = tmp_path_factory.mktemp("ours")
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": {"shape": [48, 40], "dtype": torch.float32, "optimizer": "muon",
              "states": {"param": torch.randn(48, 40, generator=g),
                         "momentum_buffer": torch.randn(48, 40, generator=g)}},
        "emb.weight": {"shape": [37, 16], "dtype": torch.bfloat16, "optimizer": "adamw",
                       "states": {"param": torch.randn(37, 16, generator=g).bfloat16(),
                                  "exp_avg": torch.randn(37, 16, generator=g)}},
    }
    write_checkpoint(str(root), tensors, 2, 5)
    return str(root)


def test_plan_imports_no_torch():
    cfg = os.path.join(ROOT, "tests", "fixtures", "hf_configs", "llama-70b.json")
    assert light(imports_of("plan", "--model", cfg, "--world-size", "64"))


def test_inspect_listing_imports_no_torch(ours):
    for path in (ours, os.path.join(FIXTURES, "zero3_w4_bf16"),
                 os.path.join(FIXTURES, "zero2_w3_fp32", "expected_zero_to_fp32.safetensors")):
        assert light(imports_of("inspect", path)), path


def test_diff_of_metadata_imports_no_torch(ours):
    ds = os.path.join(FIXTURES, "zero2_w3_fp32")
    assert light(imports_of("diff", ours, ours, "--metadata-only"))
    seen = imports_of("diff", ds, os.path.join(ds, "expected_zero_to_fp32.safetensors"),
                      "--metadata-only")
    assert light(seen)


def test_consolidate_of_our_checkpoint_imports_no_torch(ours, tmp_path):
    """bf16 parameters widen to fp32 in numpy (a bit shift), so no ml_dtypes either."""
    assert light(imports_of("consolidate", ours, tmp_path / "out"))
    from safetensors.torch import load_file
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert got["emb.weight"].dtype == torch.float32 and got["w"].shape == (48, 40)


def test_layout_imports_no_zarr_and_zarr_still_reads_bfloat16(tmp_path):
    """zarr-python learns our bfloat16 when zarr is imported after the engine's layout."""
    from offload_engine.io import AsyncFileIO
    from offload_engine.layout import FlatArray
    with AsyncFileIO() as io:
        FlatArray.create(tmp_path / "a", 6, torch.bfloat16, io=io).write(
            0, torch.arange(6, dtype=torch.bfloat16))
    code = f"""
import json, sys
import offload_engine.layout
before = {{m: m in sys.modules for m in {HEAVY!r}}}
import zarr
print(json.dumps({{"before": before, "values": zarr.open_array({str(tmp_path / "a")!r}, mode="r")[:].astype("float32").tolist()}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert not any(seen["before"].values()) and seen["values"] == [0, 1, 2, 3, 4, 5]
