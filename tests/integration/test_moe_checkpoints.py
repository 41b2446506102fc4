"""A mixture-of-experts run end to end: trained with ZeroMuon under FSDP2, checkpointed,
resharded, consolidated to Hugging Face safetensors and loaded by ``from_pretrained``.

Real processes (gloo, CPU). A tiny Qwen3-MoE (transformers 5.25, built in code: 5 experts
fused as ``mlp.experts.gate_up_proj [5, 16, 16]`` and ``down_proj [5, 16, 8]``, top-2
router) trains 3 steps at W=2, the expert stacks sharded by FSDP2 on the expert dimension
(Shard(0): 3 + 2 experts) and stepped by Muon, one matrix per expert (ZeroMuon's default
rule), the state homed on NVMe through a 16 KiB pool smaller than it. The checkpoint loads at W=3 (2 + 2 + 1 experts), which saves
again, and that one loads at W=1: every parameter and state equals the W=2 run's, bit
for bit. Both checkpoints consolidate (config.json beside them: per-expert names) into
safetensors that ``Qwen3MoeForCausalLM.from_pretrained`` loads with no key missing or left
over, and whose logits equal the trained model's, bit for bit (fp32).
"""

from __future__ import annotations

import os

import pytest
import torch

from offload_engine.checkpoint import load_checkpoint, save_checkpoint
from offload_engine.cli.main import main
from offload_engine.offline.inspect_stats import single_thread as one_thread  # as the ranks ran
from offload_engine.optim import ZeroMuon

from helpers.checkpoint_runs import store
from helpers.consolidate_outputs import load_output
from helpers.moe_models import assert_same_state, full_state, logits, tiny_qwen3_moe, tokens
from helpers.zero_muon_harness import spawn

pytestmark = pytest.mark.multiprocess

STEPS = 3
OPTIONS = dict(lr=0.02, weight_decay=0.1, adamw=dict(lr=3e-3, weight_decay=0.01))


def sharded_model(mesh, seed: int):
    """The tiny Qwen3-MoE under FSDP2: each decoder layer, then the root."""
    from torch.distributed.fsdp import fully_shard
    model = tiny_qwen3_moe(seed)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_w2(rank, world, mesh, tmp):
    model = sharded_model(mesh, seed=7)
    stack = dict(model.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"]
    assert stack.to_local().shape[0] == (3, 2)[rank]  # whole experts, on the expert dim
    config = store(os.path.join(tmp, "store_w2"))
    with ZeroMuon(model.named_parameters(), **OPTIONS, store=config) as opt:
        # the experts' state streams through a pool smaller than it, as any state does
        assert opt.layout.state_bytes() > config["cpu_budget"]
        for step in range(STEPS):
            ids = tokens(step)
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        trained = {"logits": logits(model), "state": full_state(model, opt)}
        save_checkpoint(os.path.join(tmp, "ckpt_w2"), model, opt, step=STEPS)
    if rank == 0:
        torch.save(trained, os.path.join(tmp, "trained.pt"))
        model.config.save_pretrained(os.path.join(tmp, "ckpt_w2"))


def reshard_w3(rank, world, mesh, tmp):
    model = sharded_model(mesh, seed=8)  # other values until loaded
    stack = dict(model.named_parameters())["model.layers.1.mlp.experts.down_proj"]
    assert stack.to_local().shape[0] == (2, 2, 1)[rank]
    with ZeroMuon(model.named_parameters(), **OPTIONS,
                  store=store(os.path.join(tmp, "store_w3"))) as opt:
        assert load_checkpoint(os.path.join(tmp, "ckpt_w2"), model, opt) == STEPS
        trained = torch.load(os.path.join(tmp, "trained.pt"))
        assert_same_state(full_state(model, opt), trained["state"], f"W=3 rank {rank}")
        assert torch.equal(logits(model), trained["logits"])
        save_checkpoint(os.path.join(tmp, "ckpt_w3"), model, opt, step=STEPS)
    if rank == 0:
        model.config.save_pretrained(os.path.join(tmp, "ckpt_w3"))


def test_moe_run_reshards_w2_w3_w1_and_consolidates_for_from_pretrained(tmp_path):
    from transformers import Qwen3MoeForCausalLM

    tmp = str(tmp_path)
    spawn(2, train_w2, tmp)
    spawn(3, reshard_w3, tmp)
    trained = torch.load(os.path.join(tmp, "trained.pt"))

    model = tiny_qwen3_moe(seed=9)
    with one_thread(), ZeroMuon(model.named_parameters(), **OPTIONS,
                                store=store(os.path.join(tmp, "store_w1"))) as opt:
        assert load_checkpoint(os.path.join(tmp, "ckpt_w3"), model, opt) == STEPS
        assert_same_state(full_state(model, opt), trained["state"], "W=1 from W=3")
        assert torch.equal(logits(model), trained["logits"])

    outputs = []
    for ckpt in ("ckpt_w2", "ckpt_w3"):
        out = os.path.join(tmp, f"hf_{ckpt}")
        assert main(["consolidate", os.path.join(tmp, ckpt), out, "--verify"]) == 0
        written, _ = load_output(out)
        assert "model.layers.0.mlp.experts.4.down_proj.weight" in written
        assert not any(k.endswith("gate_up_proj") for k in written)
        outputs.append(written)
        loaded, info = Qwen3MoeForCausalLM.from_pretrained(out, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] \
            and not info["mismatched_keys"], info
        with one_thread():
            assert torch.equal(logits(loaded), trained["logits"]), ckpt
    assert outputs[0].keys() == outputs[1].keys()
    assert all(torch.equal(outputs[0][k], outputs[1][k]) for k in outputs[0])
