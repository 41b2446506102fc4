"""`offload-engine plan` on mixture-of-experts configs: names, shapes and counts of the
parameter list, active parameters per token, against transformers itself and the published
totals."""

import json
import os

import pytest
import torch

from offload_engine.cli.main import main
from offload_engine.plan.model_shapes import from_hf_config, load_model
from offload_engine.plan.moe_shapes import active_params
from helpers.paths import FIXTURES

CONFIGS = os.path.join(FIXTURES, "hf_configs")

# (total, active) from the model cards: Mixtral-8x7B 46.7B / 12.9B, Qwen3-30B-A3B 30.5B / 3.3B,
# DeepSeek-V3 671B without its multi-token-prediction module / 37B
PUBLISHED = {
    "mixtral-8x7b": (46.7e9, 12.9e9),
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "deepseek-v3": (671e9, 37e9),
}


def _close(count: int, published: float) -> bool:
    """The card's figure is the count cut to the digits it states, rounded (Mistral: 12.88B
    is "12.9B") or truncated (Qwen: 3.35B is "3.3B"; DeepSeek: 37.55B is "37B")."""
    text = str(int(published))
    step = 10 ** (len(text) - len(text.rstrip("0")))
    return count // step * step == published or round(count / step) * step == published


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_moe_totals_and_active_parameters_match_the_published_figures(name):
    model = load_model(os.path.join(CONFIGS, f"{name}.json"))
    total, active = PUBLISHED[name]
    assert model.moe is not None
    assert _close(model.numel, total), (model.numel, total)
    got = active_params(model.tensors, model.moe)
    assert _close(got, active), (got, active)


def test_mixtral_exact_total_is_unchanged_by_grouping():
    # the per-expert layout of transformers 4.x and the grouped one of 5.x hold the same elements
    assert load_model(os.path.join(CONFIGS, "mixtral-8x7b.json")).numel == 46_702_792_704


def _tiny(family: str) -> dict:
    base = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 101,
            "num_experts_per_tok": 2, "tie_word_embeddings": False}
    if family == "mixtral":
        return {**base, "model_type": "mixtral", "num_local_experts": 5}
    if family == "qwen3_moe":
        return {**base, "model_type": "qwen3_moe", "num_experts": 5, "moe_intermediate_size": 24,
                "head_dim": 8, "decoder_sparse_step": 1, "mlp_only_layers": [1]}
    if family == "qwen2_moe":
        return {**base, "model_type": "qwen2_moe", "num_experts": 5, "moe_intermediate_size": 24,
                "shared_expert_intermediate_size": 40, "decoder_sparse_step": 2}
    return {**base, "model_type": "deepseek_v3", "num_key_value_heads": 4, "n_routed_experts": 5,
            "n_shared_experts": 2, "moe_intermediate_size": 24, "first_k_dense_replace": 1,
            "q_lora_rank": 16, "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8,
            "v_head_dim": 8, "n_group": 1, "topk_group": 1}


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_moe_parameter_list_is_what_transformers_builds(family):
    """Names and shapes equal ``named_parameters()`` of the transformers class (built on the
    meta device: no weights), dense layers, shared experts and latent attention included."""
    transformers = pytest.importorskip("transformers")
    cfg = _tiny(family)
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    want = {n: tuple(p.shape) for n, p in model.named_parameters()}
    got = from_hf_config(cfg, source=f"<{family}>")
    assert {t.name: t.shape for t in got.tensors} == want
    # experts a token skips: each stack's (E - k) / E
    stacks = [t for t in got.tensors if t.name.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert stacks and all(t.shape[0] == 5 for t in stacks)
    skipped = sum(t.numel for t in stacks) * 3 // 5
    assert active_params(got.tensors, got.moe) == got.numel - skipped


def test_plan_prints_the_expert_layout(capsys):
    rc = main(["plan", "--model", os.path.join(CONFIGS, "qwen3-30b-a3b.json"), "--world-size", "8",
               "--cpu-mem", "1TiB", "--nvme-capacity", "4TB", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    moe = json.loads(out)["model"]["moe"]
    assert moe["experts"] == 128 and moe["experts_per_token"] == 8 and moe["moe_layers"] == 48
    assert moe["expert_stacks"] == 96
    rc = main(["plan", "--model", os.path.join(CONFIGS, "qwen3-30b-a3b.json"), "--world-size", "8",
               "--cpu-mem", "1TiB", "--nvme-capacity", "4TB"])
    out, _ = capsys.readouterr()
    assert "128 routed experts in 48 layer(s), 8 per token" in out


# -- expert parallelism ------------------------------------------------------------------------
def _plan(capsys, *args):
    rc = main(["plan", *map(str, args), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def test_experts_are_kept_where_they_are_and_ep_shrinks_the_gathered_unit(capsys):
    """With experts on Muon, an expert is orthogonalized by the rank holding it whole: the
    Muon exchange is that of the 2-D matrices alone (the same bytes as with the experts on
    AdamW), while every expert's Newton-Schulz work lands on its holder; under ep=E/2 FSDP2
    gathers half of a block's experts."""
    qwen = os.path.join(CONFIGS, "qwen3-30b-a3b.json")
    common = ("--model", qwen, "--cpu-mem", "2TiB", "--nvme-capacity", "8TB")
    fsdp = _plan(capsys, *common, "--mesh", "dp_shard=16")
    ep = _plan(capsys, *common, "--mesh", "dp_shard=16,ep=8")
    a2a = lambda d: d["traffic"]["all_to_all_bytes_per_step_per_rank"]["sent"]
    assert a2a(fsdp) == a2a(ep) > 0
    assert ep["mesh"]["ep"] == 8 and ep["mesh"]["expert_parallel"]["experts_per_ep_rank"] == 16
    # per-rank state is the same: every rank holds 1/16 of every stack as whole experts
    assert ep["per_rank"]["state"] == fsdp["per_rank"]["state"]
    gathered = lambda d: d["per_rank"]["gpu"]["fsdp_unsharded_unit"]
    model = load_model(qwen)
    block = [t for t in model.tensors if t.name.startswith("model.layers.0.")]
    experts = sum(t.numel for t in block if ".experts." in t.name)
    dense = sum(t.numel for t in block) - experts
    root = sum(t.numel for t in model.tensors if ".layers." not in t.name)  # embeddings, head
    assert gathered(fsdp) == 2 * 2 * max(dense + experts, root)   # params + grads, bf16
    assert gathered(ep) == 2 * 2 * max(dense + experts // 8, root)
    assert gathered(ep) < gathered(fsdp)
    # Newton-Schulz: the experts' work is split over the 16 ranks holding them
    from offload_engine.optim.owners import ns_flops
    per_expert = ns_flops(2 * 768, 2048) + ns_flops(2048, 768)
    assert ep["mesh"]["newton_schulz_flops_per_step"]["experts_per_rank"] == \
        48 * 128 * per_expert // 16


def test_token_all_to_all_follows_the_documented_rule(capsys):
    qwen = os.path.join(CONFIGS, "qwen3-30b-a3b.json")
    doc = _plan(capsys, "--model", qwen, "--cpu-mem", "2TiB", "--nvme-capacity", "8TB",
                "--mesh", "dp_replicate=2,dp_shard=8,ep=4", "--tokens-per-step", 1_048_576)
    tokens = 1_048_576 / 16
    want = 4 * tokens * 8 * 2048 * 2 * 3 / 4 * 48
    assert doc["mesh"]["expert_parallel"]["token_all_to_all_bytes_per_step_per_rank"] == int(want)
    # replicas each orthogonalize their own experts: per-rank work is over the shard group
    ns = doc["mesh"]["newton_schulz_flops_per_step"]
    assert ns["per_rank"] >= ns["experts_per_rank"] > 0


@pytest.mark.parametrize("mesh, words", [
    ("dp_shard=8,ep=3", "ep=3 must divide dp_shard x tp = 8"),
    ("dp_shard=-1,ep=-1", "ep cannot be -1"),
])
def test_a_bad_ep_degree_says_what_would_work(capsys, mesh, words):
    rc = main(["plan", "--model", os.path.join(CONFIGS, "qwen3-30b-a3b.json"), "--world-size", "8",
               "--mesh", mesh])
    _, err = capsys.readouterr()
    assert rc == 2 and words in err
    if "divide" in words:
        assert "ep may be one of 1, 2, 4, 8" in err
