"""plan --mesh: a 2-D mesh (HSDP, FSDP + tensor parallel) in the planner."""

import json
import os

import pytest

from offload_engine.cli.main import main
from offload_engine.optim.owners import ns_flops
from offload_engine.plan.mesh import Mesh, check_nodes, parse_mesh
from helpers.paths import FIXTURES

L405 = os.path.join(FIXTURES, "hf_configs", "llama-3.1-405b.json")
MACHINE = ["--gpu-mem", "80GB", "--cpu-mem", "1TiB"]


def plan(capsys, *args) -> dict:
    assert main(["plan", "--model", L405, *MACHINE, *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_mesh_spellings(tmp_path):
    assert parse_mesh("dp_replicate=8,dp_shard=8,tp=4") == Mesh(8, 8, 4)
    assert parse_mesh("tp=8") == Mesh(1, 1, 8) and parse_mesh("dp_shard=8,tp=8", 64).world_size == 64
    assert parse_mesh('{"data_parallel_shard_degree": -1, "tensor_parallel_degree": 8}', 128) == Mesh(1, 16, 8)
    cfg = tmp_path / "titan.json"
    cfg.write_text(json.dumps({"parallelism": {"data_parallel_replicate_degree": 2,
                                               "data_parallel_shard_degree": 64,
                                               "tensor_parallel_degree": 1,
                                               "pipeline_parallel_degree": 1}}))
    assert parse_mesh(str(cfg)) == Mesh(2, 64, 1)


@pytest.mark.parametrize("spec, world, message", [
    ("dp=4", None, "AXIS=N"),
    ("tp=x", None, "integer"),
    ("dp_shard=-1,tp=-1", 8, "only one"),
    ("dp_shard=-1", None, "needs --world-size"),
    ("dp_shard=4,tp=2", 16, "multiply to 8"),
    ("tp=0", None, "positive"),
    ('{"pipeline_parallel_degree": 4, "tensor_parallel_degree": 2}', None, "pipeline"),
    ("{not json", None, "not valid JSON"),
])
def test_bad_mesh_specs(spec, world, message):
    with pytest.raises(ValueError, match=message):
        parse_mesh(spec, world)


def test_shard_groups_must_fill_nodes():
    check_nodes(Mesh(2, 8, 1), 8)
    check_nodes(Mesh(1, 4, 4), 8)
    with pytest.raises(ValueError, match="fill whole nodes"):
        check_nodes(Mesh(4, 2, 1), 8)


def test_405b_parameter_count_is_the_published_one(capsys):
    """Llama-3.1-405B: 126 layers of hidden 16384 (128 heads of 128, 8 KV heads), MLP 53248,
    vocabulary 128256, untied head: the 405.85 billion the model card rounds to 405B."""
    h, kv, ffn, vocab, layers = 16384, 8 * 128, 53248, 128256, 126
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h
    total = layers * per_layer + 2 * vocab * h + h
    doc = plan(capsys, "--world-size", "128")
    assert doc["model"]["params"] == total
    assert round(total / 1e9, 2) == 405.85


def test_fsdp_tp_is_the_1d_plan_over_all_ranks(capsys):
    one_d = plan(capsys, "--world-size", "128")
    mesh = plan(capsys, "--mesh", "dp_shard=16,tp=8")
    assert mesh["inputs"]["world_size"] == 128 and mesh["inputs"]["nodes"] == 16
    assert mesh["per_rank"]["state"] == one_d["per_rank"]["state"]
    assert mesh["per_node"] == one_d["per_node"]
    assert (mesh["mesh"]["all_to_all_bytes_per_step_per_rank"]["each_way"]
            == one_d["traffic"]["all_to_all_bytes_per_step_per_rank"]["sent"])


def test_hsdp_keeps_state_per_shard_group_and_splits_newton_schulz(capsys):
    doc = plan(capsys, "--mesh", "dp_replicate=2,dp_shard=64", "--home", "nvme", "--cpu-budget", "2GiB",
               "--nvme-capacity", "30TB", "--read-gbps", "25", "--write-gbps", "20")
    group = plan(capsys, "--world-size", "64", "--home", "nvme", "--cpu-budget", "2GiB", "--nvme-capacity", "30TB",
                 "--read-gbps", "25", "--write-gbps", "20")
    m = doc["mesh"]
    assert (m["world_size"], m["nodes"], m["shard_group_ranks"], m["state_copies"]) == (128, 16, 64, 2)
    assert doc["per_rank"]["state"] == group["per_rank"]["state"]  # a rank holds 1/64
    t = group["traffic"]
    assert m["nvme_bytes_per_step_per_node"]["read"] == max(t["nvme_read_bytes_per_step_per_node"]) > 0
    assert m["nvme_bytes_per_step_all_nodes"]["read"] == 16 * m["nvme_bytes_per_step_per_node"]["read"]
    muon = doc["model"]["params_muon"]
    W, D, R = 128, 64, 2
    assert m["all_to_all_bytes_per_step_per_rank"]["each_way"] == int(2 * muon * (W + D - 2) / (W * D))
    assert m["all_to_all_bytes_per_step_per_rank"]["between_replicas"] == int(2 * (R - 1) * muon / W)
    ffn = ns_flops(53248, 16384)
    assert m["newton_schulz_flops_per_step"]["per_rank"] == m["newton_schulz_flops_per_step"]["total"] // W
    assert m["newton_schulz_flops_per_step"]["total"] > 3 * 126 * ffn  # the MLP matrices alone


def test_mesh_text_output(capsys):
    assert main(["plan", "--model", L405, *MACHINE, "--mesh", "dp_replicate=2,dp_shard=64"]) == 0
    text = capsys.readouterr().out
    assert "mesh: dp_replicate 2 x dp_shard 64 x tp 1 = 128 ranks on 16 node(s)" in text
    assert "Newton-Schulz per step" in text and "between replicas" in text


def test_world_size_or_mesh_is_needed(capsys):
    assert main(["plan", "--model", L405]) == 2
    assert "--world-size" in capsys.readouterr().err


def test_compute_time_counts_every_rank_of_the_mesh(capsys):
    """6 P T / (W peak MFU) with W the whole mesh, replicas included, not one shard group."""
    tokens = ["--tokens-per-step", "16000000"]
    hsdp = plan(capsys, "--mesh", "dp_replicate=2,dp_shard=64", *tokens)
    one_d = plan(capsys, "--world-size", "128", *tokens)
    assert hsdp["traffic"]["compute_time_s_per_step"] == one_d["traffic"]["compute_time_s_per_step"]
