"""Checkpoints edited on purpose, for the tests of what readers refuse (no tests here).

- ``small_checkpoint``: a real checkpoint (``save_checkpoint``, one process) of a tiny
  model with a Muon matrix and AdamW vectors, ``fresh_model`` to load it into, and
  ``train`` to step it.
- ``edit_group``: change the attributes of a group's zarr.json (the manifest or a shard
  table), written back the way the engine writes groups.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from offload_engine.checkpoint import save_checkpoint
from offload_engine.optim import ZeroMuon

KiB = 1024


def _store(path: str) -> dict:
    return {"nvme_paths": [path], "bucket_bytes": 4 * KiB, "cpu_budget": 16 * KiB,
            "prefetch_depth": 1, "io_threads": 2}


def fresh_model(store_dir: str, seed: int = 0):
    """(model, ZeroMuon) of the tiny model: w (Muon, 24 x 8), norm and bias (AdamW)."""
    torch.manual_seed(seed)
    model = nn.Module()
    model.w = nn.Parameter(torch.randn(24, 8))
    model.norm = nn.Parameter(torch.randn(8))
    model.bias = nn.Parameter(torch.randn(24))
    opt = ZeroMuon(model.named_parameters(), lr=0.02, adamw={"lr": 1e-3},
                   store=_store(store_dir))
    return model, opt


def train(model, opt, steps) -> None:
    """Step ``opt`` once per step number in ``steps``, with gradients that depend on it."""
    for s in steps:
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.01 * (s + 1)) + 0.001 * p.detach()
        opt.step()


def small_checkpoint(tmp: str, step: int = 2) -> str:
    """``tmp/ck`` with generation ``step`` saved after ``step`` optimizer steps."""
    model, opt = fresh_model(os.path.join(tmp, "train-state"))
    for s in range(step):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.01 * (s + 1))
        opt.step()
    ck = os.path.join(tmp, "ck")
    save_checkpoint(ck, model, opt, step)
    opt.close()
    return ck


def edit_group(zarr_json: str, edit) -> None:
    """Call ``edit(attributes)`` on the group ``zarr_json`` and write it back (compact)."""
    with open(zarr_json) as f:
        doc = json.load(f)
    edit(doc["attributes"])
    with open(zarr_json, "w") as f:
        f.write(json.dumps(doc, separators=(",", ":")) + "\n")
