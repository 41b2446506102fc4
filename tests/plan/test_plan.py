"""`offload-engine plan` and the byte model in offload_engine/plan: inputs, counts, formulas.

The calibration against a real ZeroMuon + TieredStore run is in test_plan_calibration.py.
"""

import json
import os
import struct

import pytest
import torch

from offload_engine.cli.main import main
from offload_engine.optim.param_rules import default_use_muon
from offload_engine.layout.manifest import fsdp_rows
from offload_engine.plan.memory import PlanOptions, classify, rank_states
from offload_engine.plan.model_shapes import from_hf_config, load_model
from offload_engine.store import StoreConfig
from helpers.paths import FIXTURES

CONFIGS = os.path.join(FIXTURES, "hf_configs")
GiB = 1 << 30

# published totals (Hugging Face model cards / model.num_parameters())
KNOWN_COUNTS = {
    "llama-7b": 6_738_415_616,       # Llama-2-7b
    "llama-13b": 13_015_864_320,     # Llama-2-13b
    "llama-70b": 68_976_648_192,     # Llama-2-70b (GQA, 8 KV heads)
    "mistral-7b": 7_241_732_096,     # Mistral-7B-v0.1
    "qwen2-7b": 7_615_616_512,       # Qwen2-7B (q/k/v biases)
    "gpt2": 124_439_808,             # GPT-2 small, tied embeddings
    "pythia-160m": 162_322_944,      # GPT-NeoX family, untied
    "mixtral-8x7b": 46_702_792_704,  # 8 experts per layer
}


def cfg(name):
    return os.path.join(CONFIGS, f"{name}.json")


def plan_json(capsys, *args):
    rc = main(["plan", *map(str, args), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


# -- model input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(KNOWN_COUNTS))
def test_parameter_counts_match_the_published_totals(name):
    model = load_model(cfg(name))
    assert model.numel == KNOWN_COUNTS[name]
    assert len({t.name for t in model.tensors}) == len(model.tensors)


def test_tied_embeddings_count_once_and_names_follow_transformers():
    gpt2 = load_model(cfg("gpt2"))
    names = [t.name for t in gpt2.tensors]
    assert gpt2.tied_embeddings and "lm_head.weight" not in names
    assert names[:2] == ["transformer.wte.weight", "transformer.wpe.weight"]
    llama = load_model(cfg("llama-7b"))
    assert [t.name for t in llama.tensors][-1] == "lm_head.weight"
    untied = json.load(open(cfg("llama-7b")))
    tied = from_hf_config({**untied, "tie_word_embeddings": True})
    assert llama.numel - tied.numel == 32000 * 4096


@pytest.mark.parametrize("name", ["llama-7b", "gpt2", "pythia-160m", "mixtral-8x7b", "qwen2-7b"])
def test_classification_is_the_optimizers_own_rule(name):
    model = load_model(cfg(name))
    kinds = classify(model)
    for t, k in zip(model.tensors, kinds):
        want = default_use_muon(t.name, torch.zeros(t.shape) if t.numel < 10**6
                                else torch.empty(t.shape, device="meta"))
        assert (k == "muon") == want, t.name
    assert "adamw" in kinds and "muon" in kinds


def test_classification_calls_the_rule_not_a_copy(monkeypatch):
    """The planner asks the optimizer's rule itself (on names and dimensions: no tensor, so
    no torch), once per tensor."""
    import offload_engine.plan.memory as memory
    seen = []
    monkeypatch.setattr(memory, "use_muon_for", lambda n, ndim: seen.append((n, ndim)) or False)
    model = load_model(cfg("gpt2"))
    assert set(classify(model)) == {"adamw"}
    assert seen == [(t.name, len(t.shape)) for t in model.tensors]


def _write_safetensors(path, tensors, truncate=False):
    header = {name: {"dtype": dt, "shape": list(shape), "data_offsets": [0, 0]}
              for name, (dt, shape) in tensors.items()}
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        if not truncate:
            f.write(b"\0" * 64)


def test_safetensors_header_index_and_shape_list(tmp_path):
    _write_safetensors(tmp_path / "model-00001-of-00002.safetensors",
                       {"model.embed_tokens.weight": ("BF16", (100, 16)),
                        "model.layers.0.mlp.up_proj.weight": ("BF16", (32, 16))}, truncate=True)
    _write_safetensors(tmp_path / "model-00002-of-00002.safetensors",
                       {"model.norm.weight": ("F32", (16,)), "lm_head.weight": ("BF16", (100, 16))})
    index = {"metadata": {"total_size": 0}, "weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "model.layers.0.mlp.up_proj.weight": "model-00001-of-00002.safetensors",
        "model.norm.weight": "model-00002-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    for source in (tmp_path, tmp_path / "model.safetensors.index.json"):
        m = load_model(str(source))
        assert m.numel == 100 * 16 * 2 + 32 * 16 + 16
        assert classify(m) == ["adamw", "muon", "adamw", "adamw"]
    single = load_model(str(tmp_path / "model-00002-of-00002.safetensors"))
    assert {t.name: t.dtype for t in single.tensors} == {"model.norm.weight": "float32",
                                                        "lm_head.weight": "bfloat16"}
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"emb.weight": [10, 4], "w": [4, 4], "b": [4]}))
    assert load_model(str(shapes)).numel == 40 + 16 + 4
    shapes.write_text(json.dumps([{"name": "w", "shape": [3, 5], "dtype": "float32"}]))
    assert load_model(str(shapes)).tensors[0].dtype == "float32"


def test_fsdp_row_shards_are_torch_chunk_sizes():
    for rows in (0, 1, 5, 7, 10, 32000, 32001):
        for world in (1, 2, 3, 4, 8, 64):
            want = [c.shape[0] for c in torch.chunk(torch.empty(rows, 1), world)] if rows else []
            got = list(fsdp_rows(rows, world))
            assert sum(got) == rows and got[:len(want)] == want
            assert all(x == 0 for x in got[len(want):])


def test_bad_input_exits_2_with_one_line(tmp_path, capsys):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    unknown = tmp_path / "config.json"
    unknown.write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    lacking = tmp_path / "lacking.json"
    lacking.write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    not_st = tmp_path / "x.safetensors"
    not_st.write_bytes(b"\xff" * 16)
    cases = [(tmp_path / "missing.json", "no such file"), (bad_json, "not valid JSON"),
             (unknown, "unknown model family 'bert'"), (lacking, "lacks 'num_hidden_layers'"),
             (not_st, "not a safetensors file")]
    for path, words in cases:
        rc = main(["plan", "--model", str(path), "--world-size", "2"])
        out, err = capsys.readouterr()
        assert rc == 2, path
        assert err.count("\n") == 1 and words in err and "Traceback" not in err, err
    rc = main(["plan", "--model", cfg("gpt2"), "--world-size", "2", "--nvme", str(tmp_path / "nope")])
    out, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and "not an existing directory" in err


# -- the plan ----------------------------------------------------------------------------------------
PLAN_KEYS = {"format", "format_version", "model", "inputs", "per_rank", "rank_totals", "per_node",
             "placement", "verdict", "traffic", "deepspeed", "store_config"}


def test_plan_json_keys_and_emitted_config_validates(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OFFLOAD_ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "store.json"
    doc = plan_json(capsys, "--model", cfg("llama-7b"), "--world-size", 8, "--cpu-mem", "40GiB",
                    "--nvme", tmp_path, "--emit-config", out, "--read-gbps", 6, "--write-gbps", 3)
    assert PLAN_KEYS <= set(doc) and doc["format"] == "offload-engine-plan"
    assert {"gpu", "cpu", "nvme", "state", "rank"} <= set(doc["per_rank"])
    assert {"params", "grads", "fsdp_unsharded_unit", "all_to_all_buffers",
            "newton_schulz_workspace", "store_gpu_arena", "total"} <= set(doc["per_rank"]["gpu"])
    assert {"fits", "tiers", "binding", "smallest_world_size"} <= set(doc["verdict"])
    assert set(doc["verdict"]["tiers"]) == {"gpu", "cpu", "nvme"}
    t = doc["traffic"]
    assert {"nvme_read_bytes_per_step_per_rank", "nvme_written_bytes_per_step_per_node",
            "io_time_s_mean", "all_to_all_bytes_per_step_per_rank", "drive_writes_per_day"} <= set(t)
    # 40 GiB per node cannot pin 8 ranks' state: homed on NVMe, traffic and time follow
    assert doc["placement"]["default_home"] == "nvme"
    assert max(t["nvme_read_bytes_per_step_per_rank"]) > 0
    assert t["io_time_s_mean"] == pytest.approx(
        sum(t["nvme_read_bytes_per_step_per_node"]) / 2 / 6e9
        + sum(t["nvme_written_bytes_per_step_per_node"]) / 2 / 3e9)
    assert t["drive_writes_per_day"] > 0 and t["bandwidth"]["source"] == "given"
    sc = StoreConfig.from_file(str(out))
    assert sc.model_dump()["default_home"] == "nvme" and sc.nvme_paths == [str(tmp_path)]
    assert json.load(open(out)) == doc["store_config"]
    # all_to_all: the design's 4 (W-1)/W P_muon/W is the mean over ranks; the plan gives the max
    a2a = t["all_to_all_bytes_per_step_per_rank"]
    assert a2a["sent"] >= a2a["design_formula"] * 0.99


def test_state_per_parameter_follows_the_split_and_master_option():
    model = load_model(cfg("llama-7b"))
    kinds = classify(model)
    p_muon = sum(t.numel for t, k in zip(model.tensors, kinds) if k == "muon")
    p_adam = model.numel - p_muon
    for master, muon_b, adam_b in ((False, 2, 4), (True, 8, 12)):
        st = rank_states(model, PlanOptions(world_size=1, master_weights=master), kinds=kinds)[0]
        logical = sum(c.local_numel * (4 if n == "master" or master else 2)
                      for c in st.layout.bundles for n in c.arrays)
        assert logical == p_muon * muon_b + p_adam * adam_b
        # each chunk starts on a bucket boundary in every array (ZeroMuon's layout): at most
        # one bucket of padding per chunk and array
        padded = sum(a.nbytes for a in st.arrays.values())
        slack = sum(len(c.arrays) for c in st.layout.bundles) * (64 << 20)
        assert logical <= padded <= logical + slack


def test_deepspeed_adamw_only_bytes_equal_their_formula(capsys):
    # estimate_zero3_model_states_mem_needs, rewritten from research/planning_inspection.md A1
    def ds(P, L, n, N, cpu_offload, cpu_offload_params, zero_init=True, b=1.5):
        G = n * N
        if cpu_offload and cpu_offload_params:
            return (18 * P / N * b if zero_init else max(4 * n, 18 / N) * P * b), 4 * L
        if cpu_offload:
            return (16 * P / N * b if zero_init else max(4 * n, 16 / N) * P * b), 4 * L + 2 * P / G
        return (4 * L * n * b if zero_init else 4 * P * n * b), 4 * L + 18 * P / G

    for name, world, per_node in (("llama-7b", 8, 8), ("gpt2", 16, 8), ("llama-13b", 4, 4)):
        doc = plan_json(capsys, "--model", cfg(name), "--world-size", world, "--gpus-per-node",
                        per_node, "--optimizer", "adamw", "--master-offload", "--cpu-mem", "4TiB")
        P, L = doc["model"]["params"], doc["model"]["largest_layer_params"]
        n, N = per_node, world // per_node
        assert P == KNOWN_COUNTS[name] and doc["model"]["params_muon"] == 0
        rows = doc["deepspeed"]["zero3"]
        for key, off, offp in (("offload_param_and_optimizer", True, True),
                               ("offload_optimizer", True, False), ("no_offload", False, False)):
            cpu, gpu = ds(P, L, n, N, off, offp)
            assert rows[key]["cpu_bytes_per_node"] == int(cpu), (name, key)
            assert rows[key]["gpu_bytes_per_gpu"] == int(gpu), (name, key)
        cmp_ = doc["deepspeed"]["adamw_comparison"]
        # ours: master + m + v = 12 B/param on the host, exactly the formula's 16 less the
        # fp32 gradient, without the 1.5 factor; node 0 holds the ceil-sized shards (+ < 1%);
        # bucket padding comes on top and is reported on its own
        ds_cpu, _ = ds(P, L, n, N, True, False)
        ours = cmp_["ours_state_bytes_per_node"]
        assert 12 * P / N <= ours <= 12 * P / N * 1.01
        assert cmp_["ours_state_bytes_per_node_with_padding"] >= ours
        assert ds_cpu / 1.5 - cmp_["deepspeed_fp32_grads_cpu"] == pytest.approx(12 * P / N)
        # GPU: the bf16 param shard as DeepSpeed (2P/G) plus the bf16 gradient shard we keep
        assert cmp_["ours_gpu_params_grads_per_gpu"] == pytest.approx(4 * P / (n * N), rel=0.01)


def test_t5_3b_docs_check_of_the_deepspeed_formula():
    from offload_engine.plan.deepspeed_compat import estimate_zero3
    # docs/code-docs/source/memory.rst: t5-3b, 8 GPUs, offload_param + optimizer, zero_init
    cpu, gpu, _ = estimate_zero3(2851 * 10**6, 32 * 10**6, 8, 1, True, True)
    assert round(cpu / 2**30, 2) == 71.69 and round(gpu / 2**30, 2) == 0.12


def test_70b_plan_runs_and_finds_a_world_size(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    doc = plan_json(capsys, "--model", cfg("llama-70b"), "--world-size", 64, "--cpu-mem", "2TiB",
                    "--nvme-capacity", "30TB", "--read-gbps", 20, "--write-gbps", 15)
    assert doc["model"]["params"] == KNOWN_COUNTS["llama-70b"]
    assert doc["inputs"]["nodes"] == 8 and doc["verdict"]["fits"]
    w = doc["verdict"]["smallest_world_size"]
    assert w is not None and w <= 64
    # one node of 80 GB GPUs cannot hold 70B bf16 parameters + gradients (4 B/param) below 4 ranks
    assert w >= 4


def test_home_cpu_when_the_state_fits_and_nvme_when_it_does_not(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    big = plan_json(capsys, "--model", cfg("gpt2"), "--world-size", 1, "--cpu-mem", "1TiB",
                    "--nvme", tmp_path)
    assert big["placement"]["default_home"] == "cpu"
    assert big["store_config"]["nvme_paths"] == []
    assert max(big["traffic"]["nvme_read_bytes_per_step_per_rank"]) == 0
    small = plan_json(capsys, "--model", cfg("gpt2"), "--world-size", 1, "--cpu-mem", "4600MiB",
                      "--nvme", tmp_path, "--device", "cpu")
    assert small["placement"]["default_home"] == "nvme"
    assert small["verdict"]["tiers"]["nvme"]["used_bytes"] > 0
    none = plan_json(capsys, "--model", cfg("gpt2"), "--world-size", 1, "--cpu-mem", "4600MiB",
                     "--device", "cpu")
    assert none["placement"]["default_home"] == "cpu" and not none["verdict"]["fits"]
    assert none["verdict"]["binding"] == "cpu"


def test_text_output_names_every_tier(capsys):
    rc = main(["plan", "--model", cfg("mistral-7b"), "--world-size", "8", "--cpu-mem", "512GiB"])
    out, _ = capsys.readouterr()
    assert rc == 0
    for words in ("GPU per rank", "CPU per node", "NVMe per node", "verdict:", "store config:",
                  "all_to_all per step and rank"):
        assert words in out


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8, 64])
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_rank_states_equal_zero_muons_own_layout_and_exchange_plan_per_rank(world, family):
    """The planner groups identical ranks and sums owners' shares; this compares it, rank by
    rank, with ZeroMuon's build_layout, its matrices (one per expert of a stack, kept by the
    rank holding it whole), its owners and comm.plan_exchange on every rank's full rows."""
    from offload_engine.optim.comm import plan_exchange, plan_matrices
    from offload_engine.optim.owners import assign_owners, ns_flops
    from offload_engine.plan.memory import param_infos, rank_layout
    cfg = {"model_type": family, "hidden_size": 96, "intermediate_size": 200,
           "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
           "vocab_size": 301}
    if family == "qwen3_moe":  # 5 experts: whole experts on the first ranks, none on others
        cfg.update(num_experts=5, moe_intermediate_size=40, num_experts_per_tok=2, head_dim=16)
    shapes = from_hf_config(cfg)
    opts = PlanOptions(world_size=world, bucket_bytes=16384, master_weights=world % 2 == 1)
    states = rank_states(shapes, opts)
    infos = param_infos(shapes, opts)  # every rank's rows
    for r in range(world):
        layout = rank_layout(infos, r, opts)
        st = states[r]
        assert {n: (a.dtype, a.numel) for n, a in layout.arrays.items()} == {
            n: (a.dtype, a.numel) for n, a in st.arrays.items()}
        muon = [c for c in layout.bundles if c.kind == "muon"]
        spread = lambda c: c.distributed and world > 1
        mats = {c.index: plan_matrices([infos[p] for p in c.params], world, spread(c))
                for c in muon}
        dist = [c for c in muon if spread(c)]
        owners = assign_owners([[(m.rows, m.cols) for m in mats[c.index]] for c in dist], world,
                               5, candidates=[[m.candidates for m in mats[c.index]] for c in dist])
        owner_of = {c.index: o for c, o in zip(dist, owners)}
        plans = [plan_exchange([infos[p] for p in c.params],
                               owner_of.get(c.index, [r] * len(mats[c.index])), r, world,
                               c.distributed)
                 for c in muon]
        assert st.send_max == max((pl.send_total for pl in plans), default=0)
        assert st.recv_max == max((pl.recv_numel for pl in plans if not pl.local), default=0)
        sent = sum(2 * (pl.send_numel - pl.send_splits[r] + pl.recv_numel - pl.recv_splits[r])
                   for pl in plans if not pl.local)
        assert st.a2a_sent == st.a2a_received == sent
        owned = [m for pl in plans for m in pl.owned + pl.kept]
        assert st.ns_max_numel == max((m.rows * m.cols for m in owned), default=0)
        assert st.ns_max_min_dim == max((min(m.rows, m.cols) for m in owned), default=0)
        assert st.ns_flops == sum(ns_flops(m.rows, m.cols, 5) for m in owned)
        assert st.local_numel == sum(i.local_numel(r if world > 1 else 0) for i in infos)
