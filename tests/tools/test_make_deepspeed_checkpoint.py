"""tools/make_deepspeed_checkpoint.py writes what DeepSpeed 0.19.8 writes at ZeRO-3: the same
files and keys as a real checkpoint (tests/fixtures/deepspeed), and tensors that DeepSpeed's
own zero_to_fp32 and our consolidate read back bitwise equal, at every world size alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "make_deepspeed_checkpoint.py"
FIXTURES = ROOT / "tests" / "fixtures" / "deepspeed"
TIMEOUT_S = 300

pytestmark = pytest.mark.multiprocess


def make(out: Path, *args: str) -> dict:
    smoke = [] if "--tensors" in args else ["--smoke"]
    proc = subprocess.run([sys.executable, str(TOOL), "--out", str(out), *smoke, *args],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def consolidate(src: Path, out: Path) -> dict:
    cli = Path(sys.executable).parent / "offload-engine"
    proc = subprocess.run([str(cli), "consolidate", str(src), str(out)], capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(str(out / "model.safetensors"))


def load_pt(path: Path) -> dict:
    return torch.load(path, weights_only=False, mmap=True, pickle_module=_inert_pickle())


def key_tree(obj):
    """Keys (and the types of leaves) of a loaded rank file, values left out."""
    if isinstance(obj, dict):
        return {k if isinstance(k, str) else type(k).__name__: key_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [key_tree(v) for v in obj[:1]]
    return type(obj).__name__


@pytest.mark.parametrize("dtype,fixture", [("fp32", "zero3_w2_fp32"), ("bf16", "zero3_w4_bf16")])
def test_files_and_keys_match_a_real_checkpoint(tmp_path, dtype, fixture):
    world = 2 if dtype == "fp32" else 4
    make(tmp_path, "--dtype", dtype, "--world", str(world), "--sub-group-size", "3000")
    real, ours = FIXTURES / fixture, tmp_path
    assert (ours / "latest").read_text() == (real / "latest").read_text() == "global_step2"
    assert sorted(os.listdir(ours / "global_step2")) == sorted(os.listdir(real / "global_step2"))
    for name in os.listdir(real / "global_step2"):
        mine, theirs = load_pt(ours / "global_step2" / name), load_pt(real / "global_step2" / name)
        if "model_states" in name:   # the models differ: compare the dict's keys, not the modules
            mine["module"] = theirs["module"] = {}
            for d in (mine, theirs):
                d["param_shapes"] = [{}]
                d["frozen_param_shapes"] = d["frozen_param_fragments"] = d["shared_params"] = {}
                d["buffer_names"] = []
        assert key_tree(mine) == key_tree(theirs), name
        assert mine["ds_version"] == theirs["ds_version"] == "0.19.8"
        assert mine["ds_config"]["zero_optimization"]["stage"] == 3


def test_zero3_partitions_pad_each_parameter_at_its_tail(tmp_path):
    """W=3: each rank holds ceil(n/3) elements of every parameter, zeros past its end."""
    make(tmp_path, "--world", "3")
    tag = tmp_path / "global_step2"
    shapes = load_pt(tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")["param_shapes"]
    numels = [torch.Size(s).numel() for group in shapes for s in group.values()]
    parts = [-(-n // 3) for n in numels]
    for rank in range(3):
        flat = load_pt(tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        groups = flat["optimizer_state_dict"]["fp32_flat_groups"]
        assert sum(g.numel() for g in groups) == sum(parts)
        everything = torch.cat(groups)
        at = 0
        for n, part in zip(numels, parts):
            tail = everything[at + max(0, min(part, n - rank * part)):at + part]
            assert not tail.any()
            at += part


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_consolidates_the_same_model_at_every_world_size(tmp_path, dtype):
    outputs = []
    for world in (1, 2, 3):
        make(tmp_path / f"w{world}", "--dtype", dtype, "--world", str(world),
             "--sub-group-size", "5000")
        outputs.append(consolidate(tmp_path / f"w{world}", tmp_path / f"out{world}"))
    assert len(outputs[0]) == 2 + 2 * 9 + 1   # embed, lm_head, norm, 9 per block
    for other in outputs[1:]:
        assert other.keys() == outputs[0].keys()
        assert all(torch.equal(other[k], outputs[0][k]) for k in other)
    assert outputs[0]["model.embed_tokens.weight"].dtype == torch.float32


def _inert_pickle():
    """torch.load's pickle module with DeepSpeed's classes replaced by empty stand-ins."""
    import pickle
    import types

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if module.startswith("deepspeed"):
                return type(name, (), {"__init__": lambda self, *a: None,
                                       "__setstate__": lambda self, s: None})
            return super().find_class(module, name)

    return types.SimpleNamespace(Unpickler=Unpickler, load=pickle.load, __name__="inert")


DEEPSPEED_PYTHON = os.environ.get("OFFLOAD_ENGINE_DEEPSPEED_PYTHON", "/work/dsvenv/bin/python")
ZERO_TO_FP32 = """
import sys
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from safetensors.torch import save_file
state = get_fp32_state_dict_from_zero_checkpoint(sys.argv[1])
save_file({k: v.contiguous() for k, v in state.items()}, sys.argv[2])
"""


@pytest.mark.slow   # DeepSpeed's process reads about 1 GiB of libraries
@pytest.mark.skipif(not os.path.exists(DEEPSPEED_PYTHON),
                    reason=f"no interpreter with deepspeed at {DEEPSPEED_PYTHON} "
                           "(set OFFLOAD_ENGINE_DEEPSPEED_PYTHON)")
@pytest.mark.parametrize("dtype,world", [("fp32", 1), ("fp32", 2), ("bf16", 3)])
def test_deepspeed_zero_to_fp32_reads_it_as_we_do(tmp_path, dtype, world):
    src = tmp_path / "ckpt"
    make(src, "--dtype", dtype, "--world", str(world), "--sub-group-size", "5000")
    proc = subprocess.run([DEEPSPEED_PYTHON, "-c", ZERO_TO_FP32, str(src),
                           str(tmp_path / "ds.safetensors")], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = load_file(str(tmp_path / "ds.safetensors"))
    ours = consolidate(src, tmp_path / "ours")
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)


def test_more_tensors_than_a_plain_zip_counts_are_read(tmp_path):
    """66,000 parameters: a ZeRO-3 model-states file holds one zip record per parameter, past
    the 65,535 a zip without zip64 counts; inspect lists every tensor (it refused the file)."""
    make(tmp_path / "ck", "--tensors", "66000", "--params", "66000", "--hidden", "1",
         "--world", "1")
    cli = Path(sys.executable).parent / "offload-engine"
    proc = subprocess.run([str(cli), "inspect", str(tmp_path / "ck"), "--json"],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(json.loads(proc.stdout)["tensors"]) == 66000
