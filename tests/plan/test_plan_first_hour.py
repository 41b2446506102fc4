"""`offload-engine plan` answers the question a new user asks (issue 31, item 1): it says
where figures it was not given come from, refuses sizes without a unit, says that it reads
local files only, labels the model by what it is, and answers a refused --mesh with meshes
that would work."""

import json
import os

import pytest

from offload_engine.cli.main import main
from helpers.paths import FIXTURES

CONFIGS = os.path.join(FIXTURES, "hf_configs")
LLAMA_70B = os.path.join(CONFIGS, "llama-70b.json")


def run(capsys, *args):
    try:
        rc = main(["plan", *map(str, args)])
    except SystemExit as e:       # argparse refusals
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_host_memory_taken_from_this_machine_is_said_and_the_flag_named(capsys):
    rc, out, _ = run(capsys, "--model", LLAMA_70B, "--world-size", 8, "--nvme-capacity", "2TB")
    assert rc == 0
    assert "host memory per node is this machine's" in out and "--cpu-mem SIZE" in out
    rc, out, _ = run(capsys, "--model", LLAMA_70B, "--world-size", 8, "--nvme-capacity", "2TB",
                     "--cpu-mem", "1TiB", "--json")
    doc = json.loads(out)
    assert doc["inputs"]["cpu_mem_source"] == "given"
    assert not any("this machine's" in n for n in doc["verdict"]["notes"])


def test_a_smaller_world_size_that_fits_is_explained(capsys):
    rc, out, _ = run(capsys, "--model", LLAMA_70B, "--world-size", 8, "--nvme-capacity", "2TB",
                     "--cpu-mem", "24GiB", "--json")
    doc = json.loads(out)
    v = doc["verdict"]
    assert not v["fits"] and v["smallest_world_size"] and v["smallest_world_size"] < 8
    assert any("fewer ranks share each node's host memory" in n for n in v["notes"])


@pytest.mark.parametrize("flag", ["--gpu-mem", "--cpu-mem", "--nvme-capacity", "--cpu-budget"])
def test_a_size_without_a_unit_is_refused_with_the_likely_meaning(capsys, flag):
    rc, _, err = run(capsys, "--model", LLAMA_70B, "--world-size", 8, flag, "80")
    assert rc == 2
    assert "'80' has no unit: write 80GB or 80GiB" in err


def test_a_gpu_too_small_to_use_is_refused_not_planned_negative(capsys):
    rc, out, err = run(capsys, "--model", LLAMA_70B, "--world-size", 8, "--gpu-mem", "500MiB",
                       "--json")
    assert rc == 2 and "nothing is usable" in err and not out


def test_a_hub_id_is_told_that_only_local_files_are_read(capsys):
    rc, _, err = run(capsys, "--model", "meta-llama/Llama-2-70b-hf", "--world-size", 8)
    assert rc == 2
    assert "reads local files only and downloads nothing" in err
    assert "config.json" in err
    rc, _, err = run(capsys, "--model", "./no/such/config.json", "--world-size", 8)
    assert rc == 2 and "no such file or directory" in err


def test_a_config_without_a_name_is_labelled_by_its_architecture(capsys, tmp_path):
    with open(os.path.join(CONFIGS, "llama-7b.json")) as f:
        cfg = json.load(f)
    cfg.pop("_name_or_path", None)
    folder = tmp_path / "tmpk3j2x"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    rc, out, _ = run(capsys, "--model", folder, "--world-size", 8, "--cpu-mem", "1TiB")
    assert rc == 0
    first = out.splitlines()[0]
    assert first.startswith("plan: LlamaForCausalLM from ") and "tmpk3j2x/config.json" in first


@pytest.mark.parametrize("mesh, world, words", [
    ("dp_replicate=8,dp_shard=2", None, "These would: dp_replicate=2,dp_shard=8,tp=1"),
    ("dp_shard=4", 8, "set one degree to -1 to take the rest"),
    ("dp_shard=12", None, "--gpus-per-node 6 would"),
])
def test_a_refused_mesh_says_what_would_work(capsys, mesh, world, words):
    args = ["--model", LLAMA_70B, "--mesh", mesh] + (["--world-size", world] if world else [])
    rc, _, err = run(capsys, *args)
    assert rc == 2 and words in err, err
