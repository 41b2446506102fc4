"""Mixture-of-experts models and the per-expert torch reference for ZeroMuon's expert tests.

- ``MoE(grouped=True)``: torchtitan / DeepSeek-V3 / transformers 5.x style, one module
  ``experts`` holding 3-D stacks ``w1 [E, F, D]``, ``w2 [E, D, F]``, ``w3 [E, F, D]``;
  ``grouped=False``: Hugging Face 4.x style, ``experts.{e}.w1|w2|w3`` Linear layers (2-D).
  Both have a router ``gate`` (Linear(D, E)), top-2 token choice, an embedding, a norm and
  an output head. ``expert_bias`` (a buffer, as torchtitan's) steers the routing: an expert
  with a large negative bias gets no tokens.
- ``SliceReference``: ``torch.optim.Muon`` on each expert slice of every stack as its own 2-D
  parameter (the bitwise reference the issue names), Muon on the other matrices, AdamW on the
  rest; per-expert ModuleList weights are ordinary 2-D parameters there.
- ``check_parity``: every parameter and every state tensor of this rank's part equal to the
  reference, bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from offload_engine.optim import default_use_muon
from helpers.zero_muon_harness import local_part


class GroupedExperts(nn.Module):
    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) / dim ** 0.5)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden) / hidden ** 0.5)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, dim) / dim ** 0.5)

    def run(self, e: int, x):
        return (F.silu(x @ self.w1[e].T) * (x @ self.w3[e].T)) @ self.w2[e].T


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """A one-layer language model with a top-2 token-choice mixture of experts."""

    def __init__(self, grouped: bool, experts: int = 4, dim: int = 8, hidden: int = 6,
                 vocab: int = 13, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.grouped = grouped
        self.num_experts = experts
        self.embed = nn.Embedding(vocab, dim)
        self.gate = nn.Linear(dim, experts, bias=False)
        if grouped:
            self.experts = GroupedExperts(experts, dim, hidden)
        else:
            self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(experts))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("expert_bias", torch.zeros(experts))

    def forward(self, tokens):
        x = self.embed(tokens).reshape(-1, self.embed.embedding_dim)
        scores = self.gate(x).softmax(-1)
        _, chosen = (scores + self.expert_bias).topk(2, dim=-1)   # the bias only steers
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, slot = (chosen == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue   # no tokens: no gradient (None for a 2-D expert, zeros in a stack)
            y = self.experts.run(e, x[tok]) if self.grouped else self.experts[e](x[tok])
            out = out.index_add(0, tok, y * scores[tok, e].unsqueeze(-1))
        h = self.norm(x + out)
        return self.lm_head(h).reshape(*tokens.shape, -1)


def mlp_shapes(experts: int, dim: int = 8, hidden: int = 6) -> dict:
    """A Bag of parameters with grouped stacks, a router and AdamW parameters (no forward):
    for the placement tests, which set gradients directly."""
    return {"embed_tokens": (11, dim), "gate": (experts, dim),
            "experts.w1": (experts, hidden, dim), "experts.w2": (experts, dim, hidden),
            "experts.w3": (experts, hidden, dim), "dense": (7, dim), "norm": (dim,),
            "lm_head": (11, dim)}


class SliceReference:
    """torch.optim.Muon with each expert slice of every 3-D Muon parameter as its own 2-D
    parameter, plus torch.optim.AdamW for the rest, on the unsharded twin ``ref``."""

    def __init__(self, ref: nn.Module, muon_kw: dict, adamw_kw: dict, rule=None):
        # the models here have no 3-D parameter but expert stacks: Muon, whatever the rule says
        rule = rule or (lambda n, p: p.ndim == 3 or default_use_muon(n, p))
        self.ref = ref
        self.stacks: dict[str, tuple[nn.Parameter, list[nn.Parameter]]] = {}
        muon, adamw = [], []
        for n, p in ref.named_parameters():
            if not rule(n, p):
                adamw.append(p)
            elif p.ndim == 3:
                slices = [nn.Parameter(p.detach()[e].clone()) for e in range(p.shape[0])]
                self.stacks[n] = (p, slices)
                muon += slices
            else:
                muon.append(p)
        self.opts = [torch.optim.Muon(muon, **muon_kw)] if muon else []
        if adamw:
            self.opts.append(torch.optim.AdamW(adamw, **adamw_kw))

    @torch.no_grad()
    def step(self) -> None:
        for p, slices in self.stacks.values():
            for e, s in enumerate(slices):
                s.grad = None if p.grad is None else p.grad[e].clone()
        for o in self.opts:
            o.step()
        for p, slices in self.stacks.values():
            for e, s in enumerate(slices):
                p[e].copy_(s)

    def zero_grad(self) -> None:
        for o in self.opts:
            o.zero_grad()
        self.ref.zero_grad()

    def state_of(self, name: str, p) -> dict:
        """The reference's state of parameter ``name`` (a stack's slices stacked again)."""
        if name in self.stacks:
            _, slices = self.stacks[name]
            states = [self.opts[0].state.get(s, {}) for s in slices]
            if not states[0]:
                return {}
            return {k: torch.stack([st[k] for st in states]) for k in states[0]}
        for o in self.opts:
            if p in o.state:
                return dict(o.state[p])
        return {}


def check_parity(opt, model, sref: SliceReference, where: str, masters: bool = False,
                 only=None) -> None:
    """This rank's part of every parameter (those named in ``only``, when given) and every
    state tensor equals the reference's, bit for bit. ``masters``: the reference ran in fp32
    on the upcast gradients; ZeroMuon's masters equal it and its bf16 parameters are that
    rounded."""
    from torch.distributed.tensor import DTensor
    ref_params = dict(sref.ref.named_parameters())
    mine = lambda t, p: t.to_local() if isinstance(t, DTensor) else t
    want = lambda t, p: local_part(t, p) if isinstance(p, DTensor) else t
    sd = opt.state_dict()
    index = {info.name: info.index for info in opt.infos}
    for name, p in model.named_parameters():
        if only is not None and name not in only:
            continue
        q = ref_params[name].detach()
        expect = want(q, p)
        got = mine(p, p)
        if not torch.equal(got, expect.to(got.dtype)):
            raise AssertionError(f"{where}: parameter {name} differs")
        have = sd["state"].get(index[name], {})
        if masters and "master_param" in have:
            if not torch.equal(mine(have["master_param"], p), expect):
                raise AssertionError(f"{where}: master of {name} differs")
        have = {k: v for k, v in have.items() if k != "master_param"}
        ref_state = sref.state_of(name, ref_params[name])
        if set(have) != set(ref_state):
            raise AssertionError(f"{where}: state keys of {name}: {sorted(have)} vs {sorted(ref_state)}")
        for k, v in ref_state.items():
            h = have[k]
            w = v if k == "step" else want(v, p)
            if not torch.equal(mine(h, p), w):
                raise AssertionError(f"{where}: state {k} of {name} differs")


# -- placements ----------------------------------------------------------------------------------
class ExpertBag(nn.Module):
    """Parameters only: ``experts.<name>`` stacks ([E, out, in]) and one module per dense
    parameter, ``dense.<name>.weight`` (so that the rule sees ``embed_tokens`` and
    ``lm_head`` as modules: AdamW), for the placement tests, which set gradients directly
    (``harness.set_grads``)."""

    def __init__(self, experts: dict, dense: dict, seed: int = 0):
        super().__init__()
        from helpers.zero_muon_harness import Bag
        self.dense = nn.Module()
        for i, (name, shape) in enumerate(dense.items()):
            self.dense.add_module(name, Bag({"weight": shape}, seed + 2 + i))
        self.experts = Bag(experts, seed + 1)


def odd_shapes(experts: int, scale: int = 1) -> tuple[dict, dict]:
    """(expert stacks, dense parameters): stacks whose rows (2, 1) are fewer than the ranks,
    a router, an uneven matrix, AdamW parameters; ``scale`` multiplies the other dims."""
    s = scale
    return ({"w1": (experts, 6 * s, 8 * s), "w2": (experts, 8 * s, 6 * s),
             "w_short": (experts, 2, 9 * s), "w_row": (experts, 1, 5 * s)},
            {"embed_tokens": (11, 8 * s), "gate": (experts, 8 * s), "w": (7, 8 * s),
             "norm": (8 * s,), "lm_head": (11, 8 * s)})


def even_shapes(experts: int) -> tuple[dict, dict]:
    """(expert stacks, dense matrices) that split evenly on 2 and 4 ranks, and whose owners
    do too (4 dense matrices)."""
    return ({"w1": (experts, 8, 8), "w2": (experts, 8, 8)}, {f"w{i}": (8, 8) for i in range(4)})


def distribute_(module: nn.Module, mesh, placements) -> None:
    """Replace the parameters of ``module`` and its children by DTensors on ``mesh`` with
    ``placements``: one for all, or a dict from the child's name (or the parameter's name
    for ``module``'s own) to placements."""
    from torch.distributed.tensor import distribute_tensor
    for mod_name, mod in list(module.named_modules()):
        for n, p in list(mod.named_parameters(recurse=False)):
            pl = placements[mod_name or n] if isinstance(placements, dict) else placements
            mod.register_parameter(n, nn.Parameter(distribute_tensor(p.detach(), mesh, pl)))
