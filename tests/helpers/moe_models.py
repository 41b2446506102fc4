"""Tiny Hugging Face mixture-of-experts models built in code (no downloads), and the
checks the MoE checkpoint tests share (no tests here).

transformers 5.25 holds their experts fused: ``mlp.experts.gate_up_proj [E, 2I, H]`` and
``mlp.experts.down_proj [E, H, I]``, the router ``mlp.gate.weight [E, H]``.
"""

from __future__ import annotations

import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

VOCAB = 64


def qwen3_moe_config(experts: int = 5) -> Qwen3MoeConfig:
    """Two MoE layers of ``experts`` experts, top-2, hidden 16, expert width 8."""
    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                          moe_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=8, num_experts=experts,
                          num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                          max_position_embeddings=64)


def mixtral_config(experts: int = 4) -> MixtralConfig:
    return MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=8,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=8, num_local_experts=experts, num_experts_per_tok=2,
                         max_position_embeddings=64)


def tiny_qwen3_moe(seed: int, experts: int = 5) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(qwen3_moe_config(experts))


def tiny_mixtral(seed: int, experts: int = 4) -> MixtralForCausalLM:
    torch.manual_seed(seed)
    return MixtralForCausalLM(mixtral_config(experts))


def tokens(step: int, batch: int = 2, length: int = 12) -> torch.Tensor:
    """The step's token batch (the same on every rank)."""
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, VOCAB, (batch, length), generator=g)


def logits(model, step: int = 99) -> torch.Tensor:
    """Logits of ``tokens(step)`` in eval mode, no gradient. An FSDP2 model is resharded
    after: its root keeps its parameters unsharded after a forward (for the backward that
    would follow), and a checkpoint saved then would see plain tensors, not its shards."""
    model.eval()
    with torch.no_grad():
        out = model(tokens(step)).logits
    model.train()
    if hasattr(model, "reshard"):
        model.reshard()
    return out.detach()


def full_state(model, opt) -> dict:
    """``{(name, key): full tensor}`` of every parameter (key "param") and optimizer state,
    gathered (a collective on every rank of a sharded model)."""
    from torch.distributed.tensor import DTensor

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()

    out = {}
    index = {i.name: i.index for i in opt.infos}
    sd = opt.state_dict()["state"]
    for name, p in model.named_parameters():
        out[(name, "param")] = full(p)
        for key, v in sd.get(index[name], {}).items():
            out[(name, key)] = full(v) if torch.is_tensor(v) else v
    return out


def assert_same_state(have: dict, want: dict, where: str) -> None:
    """Every tensor of ``want`` equals ``have``'s, bit for bit (and the same keys)."""
    assert set(have) == set(want), f"{where}: {sorted(set(have) ^ set(want))}"
    for key, w in want.items():
        h = have[key]
        if torch.is_tensor(w):
            assert h.dtype == w.dtype and torch.equal(h, w), f"{where}: {key} differs"
        else:
            assert h == w, f"{where}: {key}: {h} != {w}"
