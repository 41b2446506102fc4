"""The option sets ZeroMuon's parity tests run (CASES), the store configurations they use, one
step of ZeroMuon and its references, and a small language-model-like MLP."""

from __future__ import annotations

import torch
from torch import nn

KiB = 4096

# (muon options, adamw options, store kind, extra) -- together they cover nesterov on/off,
# both adjust_lr_fn values, non-zero weight decay, both home tiers, both walking directions
CASES = [
    (dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True),
     dict(lr=3e-3, weight_decay=0.05), "nvme_evict", {}),
    (dict(lr=0.01, weight_decay=0.05, momentum=0.9, nesterov=False, adjust_lr_fn="match_rms_adamw"),
     dict(lr=1e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1), "cpu", {}),
    (dict(lr=0.03, weight_decay=0.2, nesterov=True, adjust_lr_fn="match_rms_adamw"),
     dict(lr=2e-3, weight_decay=0.01, amsgrad=True), "nvme_fixed_order", {"scheduler": True}),
    (dict(lr=0.02, weight_decay=0.1, nesterov=False, adjust_lr_fn="original", ns_steps=3),
     dict(lr=1e-3, weight_decay=0.0), "nvme_evict", {"clip": 0.5}),
]


def step_and_zero(opt, ref_opts, scheds) -> None:
    """One step of ZeroMuon and of the references, their schedulers, then zero_grad."""
    for o in (opt, *ref_opts):
        o.step()
    for s in scheds:
        s.step()
    for o in (opt, *ref_opts):
        o.zero_grad()


def store_config(kind: str, path: str) -> dict:
    if kind == "cpu":
        return {"default_home": "cpu", "bucket_bytes": KiB, "cpu_budget": 64 * KiB}
    # 5 buckets: an amsgrad AdamW row (3) while a momentum bucket two Muon chunks share is
    # kept (1), plus a spare; the state is 10-12 buckets, so most of it is evicted each step
    cfg = {"nvme_paths": [path], "bucket_bytes": KiB, "cpu_budget": 5 * KiB,
           "prefetch_depth": 1, "acquire_timeout_s": 20, "io_threads": 2}
    if kind == "nvme_fixed_order":
        cfg["alternate_order"] = False
        cfg["cpu_budget"] = 6 * KiB
    return cfg


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(13, 12)
        self.up = nn.Linear(12, 20)
        self.down = nn.Linear(20, 12)
        self.norm = nn.LayerNorm(12)
        self.lm_head = nn.Linear(12, 13, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.down(torch.relu(self.up(h)))
        return self.lm_head(self.norm(h))
