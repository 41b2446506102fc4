"""Expert weights on one process: which parameters are stacks of expert matrices, the log
line for the other non-matrices, and bitwise parity with torch.optim.Muon on each expert
slice (grouped 3-D stacks and per-expert ModuleList Linear layers) through a top-2 router
where some experts get no tokens."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from offload_engine.errors import UsageError
from offload_engine.optim import ZeroMuon, default_use_muon, use_muon_for
from offload_engine.optim.param_rules import is_expert_stack
from helpers.zero_muon_experts import MoE, SliceReference, check_parity


@pytest.mark.parametrize("name, ndim, muon", [
    ("layers.0.moe.experts.w1", 3, True),                      # torchtitan
    ("model.layers.0.mlp.experts.gate_up_proj", 3, True),      # transformers 5.x fused
    ("model.layers.0.mlp.experts.down_proj", 3, True),
    ("_orig_mod.layers.1.moe.experts.w2", 3, True),            # torch.compile prefix
    ("model.layers.0.block_sparse_moe.experts.3.w1.weight", 2, True),   # Mixtral 4.x
    ("model.layers.0.mlp.experts.7.gate_proj.weight", 2, True),         # Qwen3-MoE 4.x
    ("model.layers.0.mlp.gate.weight", 2, True),               # router: Muon (Moonlight)
    ("layers.0.moe.router.gate.weight", 2, True),
    ("layers.0.moe.expert_bias", 1, False),
    ("layers.0.conv.weight", 3, False),                        # 3-D, not experts
    ("layers.0.experts_conv.weight", 3, False),                # the module must be "experts"
    ("layers.0.moe.experts.w1", 4, False),
    ("model.embed_experts.w1", 3, False),                      # an embedding stays on AdamW
    (None, 3, False),
])
def test_the_rule_recognizes_expert_stacks_by_name_and_ndim(name, ndim, muon):
    assert use_muon_for(name, ndim) is muon
    assert default_use_muon(name, torch.empty((2,) * ndim)) is muon
    assert is_expert_stack(name, ndim) is (ndim == 3 and muon)


def test_other_non_matrices_are_named_once_in_a_log_line(caplog):
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 3, 3)
            self.table = nn.Parameter(torch.randn(3, 4, 5))     # 3-D, not named experts
            self.w = nn.Parameter(torch.randn(4, 4))
    m = Odd()
    with caplog.at_level(logging.INFO, logger="offload_engine.optim.zero_muon"):
        with ZeroMuon(m.named_parameters()) as opt:
            kinds = {i.name: i.kind for i in opt.infos}
    assert kinds == {"conv.weight": "adamw", "conv.bias": "adamw", "table": "adamw", "w": "muon"}
    lines = [r.getMessage() for r in caplog.records if "stay on AdamW" in r.getMessage()]
    assert len(lines) == 1
    assert "conv.weight [3, 2, 3, 3]" in lines[0] and "table [3, 4, 5]" in lines[0]
    assert "conv.bias" not in lines[0]


def test_expert_params_names_stacks_the_default_rule_misses():
    m = nn.Module()
    m.moe_w1 = nn.Parameter(torch.randn(3, 4, 5))
    m.norm = nn.Parameter(torch.randn(5))
    with ZeroMuon(m.named_parameters(), expert_params=r"moe_w\d") as opt:
        assert [i.kind for i in opt.infos] == ["muon", "adamw"]
        assert opt.infos[0].matrices == 3 and opt.infos[0].matrix_shape == (4, 5)
    with ZeroMuon(m.named_parameters(), expert_params=lambda n, p: n == "moe_w1") as opt:
        assert [i.kind for i in opt.infos] == ["muon", "adamw"]
    with pytest.raises(ValueError, match="expert_params matched parameter norm of shape"):
        ZeroMuon(m.named_parameters(), expert_params="norm|moe")
    with pytest.raises(UsageError, match="expert_params or use_muon_rule, not both"):
        ZeroMuon(m.named_parameters(), expert_params="moe", use_muon_rule=lambda n, p: True)
    # use_muon_rule overrides the default: experts on AdamW, or any 3-D tensor on Muon
    with ZeroMuon(m.named_parameters(), use_muon_rule=lambda n, p: p.ndim == 3) as opt:
        assert [i.kind for i in opt.infos] == ["muon", "adamw"]
    with pytest.raises(ValueError, match="Muon only supports 2D"):
        ZeroMuon([{"params": [nn.Parameter(torch.randn(2, 2, 2, 2))], "use_muon": True}])


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("masters", [False, True])
def test_top2_router_training_equals_per_expert_torch_muon(grouped, masters, tmp_path):
    """4 steps of forward/backward; expert ``step % 4`` gets no tokens in each (zero gradients
    in a stack; None for a per-expert Linear, which torch Muon skips): every parameter and
    state tensor bitwise equal to torch Muon on each expert slice + AdamW. With bf16
    parameters and fp32 masters, on NVMe through a pool smaller than the state."""
    model = MoE(grouped, experts=4, dim=16 if masters else 8, hidden=24 if masters else 6)
    if masters:
        model = model.bfloat16()
    ref = copy.deepcopy(model).float()     # starts from the same (bf16-rounded) values
    kw, akw = dict(lr=0.02, weight_decay=0.1), dict(lr=3e-3, weight_decay=0.01)
    store = None
    if masters:
        store = {"nvme_paths": [str(tmp_path)], "bucket_bytes": 4096, "cpu_budget": 10 * 4096,
                 "prefetch_depth": 1}
    opt = ZeroMuon(model.named_parameters(), **kw, adamw=akw, master_weights=masters, store=store)
    sref = SliceReference(ref, kw, akw)
    g = torch.Generator().manual_seed(0)
    try:
        for step in range(4):
            tokens = torch.randint(0, 13, (2, 5), generator=g)
            for m in (model, ref):
                m.expert_bias.zero_()
                m.expert_bias[step % 4] = -1e4
            model(tokens).float().pow(2).mean().backward()
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                q.grad = None if p.grad is None else p.grad.float()   # the same gradients
            cold = model.experts.w1.grad[step % 4] if grouped else model.experts[step % 4].w1.weight.grad
            assert (cold is None) if not grouped else not cold.any()
            opt.step()
            sref.step()
            opt.zero_grad()
            sref.zero_grad()
            check_parity(opt, model, sref, f"step {step}", masters=masters)
        st = opt.last_step_stats
        if masters:   # the state went through a smaller pool
            assert opt.layout.state_bytes() > 10 * 4096 and st.store_bytes_read["nvme"] > 0
        assert st.ns_calls == 1 + 3 * (4 if grouped else 3)    # router + every expert matrix
    finally:
        opt.close()


def test_transformers_fused_experts_equal_per_expert_torch_muon():
    """A tiny transformers 5.x Qwen3-MoE (built in code): its fused ``gate_up_proj [E, 2I, H]``
    and ``down_proj [E, H, I]`` and its router use Muon, one matrix per expert, and two
    training steps equal torch Muon on each expert slice + AdamW, bit for bit."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).float()
    ref = copy.deepcopy(model)
    kw, akw = dict(lr=0.02), dict(lr=1e-3)
    with ZeroMuon(model.named_parameters(), **kw, adamw=akw, model=model) as opt:
        kinds = {i.name: (i.kind, i.matrices) for i in opt.infos}
        assert kinds["model.layers.0.mlp.experts.gate_up_proj"] == ("muon", 4)
        assert kinds["model.layers.0.mlp.experts.down_proj"] == ("muon", 4)
        assert kinds["model.layers.0.mlp.gate.weight"] == ("muon", 1)
        assert kinds["model.embed_tokens.weight"][0] == kinds["lm_head.weight"][0] == "adamw"
        sref = SliceReference(ref, kw, akw)
        for step in range(2):
            ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(step))
            model(input_ids=ids, labels=ids).loss.backward()
            for p, q in zip(model.parameters(), ref.parameters()):
                q.grad = None if p.grad is None else p.grad.clone()
            opt.step()
            sref.step()
            opt.zero_grad()
            sref.zero_grad()
            check_parity(opt, model, sref, f"step {step}")


def test_state_dict_of_expert_stacks_round_trips():
    """A stack's momentum is one tensor of the stack's shape; loading it into a fresh
    optimizer continues bit for bit."""
    torch.manual_seed(0)
    model = MoE(True, experts=3)
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=g) for p in model.parameters()] for _ in range(4)]
    with ZeroMuon(model.named_parameters(), lr=0.02) as a:
        for step in range(2):
            for p, gr in zip(model.parameters(), grads[step]):
                p.grad = gr.clone()
            a.step()
        sd = a.state_dict()
        index = {i.name: i.index for i in a.infos}
        assert sd["state"][index["experts.w1"]]["momentum_buffer"].shape == (3, 6, 8)
        with torch.no_grad():
            for p, q in zip(twin.parameters(), model.parameters()):
                p.copy_(q)
        with ZeroMuon(twin.named_parameters(), lr=0.02) as b:
            b.load_state_dict(sd)
            for step in range(2, 4):
                for m, o in ((model, a), (twin, b)):
                    for p, gr in zip(m.parameters(), grads[step]):
                        p.grad = gr.clone()
                    o.step()
            for p, q in zip(model.parameters(), twin.parameters()):
                assert torch.equal(p, q)
