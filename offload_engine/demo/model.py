"""A small decoder-only transformer (pre-norm, RMSNorm, causal attention, GELU MLP).

Sized by ``ModelConfig``; the "small" preset has about 11 M parameters, enough to show
every part of the engine (Muon matrices, AdamW embeddings/norms/biases, a tied-free output
head) in a few minutes on two CPU cores. The "moe" preset replaces each MLP with a
mixture of experts (``MoEFeedForward``): a top-2 token-choice router and grouped SwiGLU
experts stored as torchtitan stores them, ``experts.w1/w3 [E, F, D]`` and
``experts.w2 [E, D, F]``, so ZeroMuon orthogonalizes each expert as its own matrix.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 512
    d_model: int = 384
    n_layers: int = 6
    n_heads: int = 6
    d_ff: int = 1536
    max_seq_len: int = 128
    dropout: float = 0.0    # after attention and MLP, in training (draws from torch's RNG)
    n_experts: int = 0      # > 0: each MLP is a mixture of this many experts of width d_ff
    top_k: int = 2          # experts each token is routed to

    def as_dict(self) -> dict:
        return asdict(self)


PRESETS = {
    "tiny": ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=32),
    "small": ModelConfig(),
    "medium": ModelConfig(d_model=640, n_layers=8, n_heads=10, d_ff=2560),
    "moe": ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, d_ff=96,
                       max_seq_len=64, n_experts=4, top_k=2),
}


class GroupedExperts(nn.Module):
    """E SwiGLU experts as three stacks, one matrix per expert on dim 0 (torchtitan's layout)."""

    def __init__(self, n_experts: int, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        self.w3 = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        for w, fan_in in ((self.w1, d_model), (self.w2, d_ff), (self.w3, d_model)):
            nn.init.normal_(w, std=fan_in ** -0.5)

    def forward(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Expert ``e`` on tokens ``x`` [n, d_model]."""
        return (F.silu(x @ self.w1[e].T) * (x @ self.w3[e].T)) @ self.w2[e].T


class MoEFeedForward(nn.Module):
    """Top-k token-choice routing: each token goes to the k experts its router scores
    highest, weighted by their softmax scores renormalized over the k. Experts run one after
    another on the tokens routed to them (an expert no token chose does no work and gets a
    zero gradient)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)   # the router
        self.experts = GroupedExperts(cfg.n_experts, cfg.d_model, cfg.d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = self.gate(x).softmax(dim=-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(self.experts.w1.shape[0]):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():
                y = self.experts(x[token], e) * weights[token, slot, None]
                out = out.index_add(0, token, y)
        return out.reshape(shape)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.attn_norm = nn.RMSNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.mlp_norm = nn.RMSNorm(cfg.d_model)
        if cfg.n_experts:
            self.moe = MoEFeedForward(cfg)
        else:
            self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=True)
            self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=True)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(d, dim=-1)
        shape = (b, t, self.n_heads, d // self.n_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        h = self.mlp_norm(x)
        mlp = self.moe(h) if hasattr(self, "moe") else self.down(F.gelu(self.up(h)))
        return x + self.drop(mlp)


class TinyLM(nn.Module):
    """Token embedding, positional embedding, ``n_layers`` blocks, final norm, output head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_positions = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed_tokens(tokens) + self.embed_positions(pos)
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.norm(x))


def build_model(preset: str | ModelConfig, seed: int = 0, dropout: float | None = None) -> TinyLM:
    """A model with deterministic initial weights (same ``seed``, same bits); ``dropout``
    replaces the preset's."""
    cfg = PRESETS[preset] if isinstance(preset, str) else preset
    if dropout is not None:
        cfg = replace(cfg, dropout=dropout)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return TinyLM(cfg)
    finally:
        torch.random.set_rng_state(gen_state)


def count_parameters(model: nn.Module) -> int:
    """Elements of all parameters."""
    return sum(p.numel() for p in model.parameters())
