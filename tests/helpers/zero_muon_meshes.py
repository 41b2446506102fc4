"""Models split the ways real 1-D and 2-D meshes split them, for the ZeroMuon mesh tests.

- ``hsdp(mesh)``: ``fully_shard`` over a (replicate, shard) mesh: ``(Replicate(), Shard(0))``.
- ``fsdp_tp(mesh)``: tensor parallel over ``mesh["tp"]`` (ColwiseParallel: ``Shard(0)``,
  RowwiseParallel: ``Shard(1)``, SequenceParallel norm: ``Replicate()``), then
  ``fully_shard`` over ``mesh["dp"]``: ``(_StridedShard(0), Shard(0))``, ``(Shard(0),
  Shard(1))``, ``(Shard(0), Replicate())``; modules without tensor parallelism land on the
  dp sub-mesh (``Shard(0)``, replicated across tp).
- ``tp(mesh)``: tensor parallel alone on a 1-D mesh: ``Shard(0)``, ``Shard(1)`` and
  ``Replicate()`` (modules without a plan, a Muon matrix among them) side by side.

Shapes are odd on purpose: rows fewer than ranks, ``[1, N]`` matrices, columns not
divisible by the tp size, a matrix over several 4 KiB buckets.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class TPBag(nn.Module):
    """Linear layers and norms of odd shapes (weight ``(out, in)``), nothing else."""

    # name -> (in, out, bias, tensor-parallel style: "col" | "row" | None)
    LINEARS = {
        "up": (6, 7, True, "col"),        # Muon (7, 6), bias AdamW; 7 rows over 2 or 3 ranks
        "down": (7, 5, False, "row"),     # Muon (5, 7): 7 columns over tp 2 or 3
        "tall": (8, 24, False, "col"),    # Muon, rows > cols
        "wide": (40, 8, False, "row"),    # Muon, cols > rows
        "row": (33, 1, False, "col"),     # Muon [1, 33]: one row, fewer than the ranks
        "rowr": (9, 1, False, "row"),     # Muon [1, 9]: one row, 9 columns over tp
        "short": (9, 2, False, "col"),    # Muon (2, 9): 2 rows over 3 ranks
        "big": (64, 96, False, "row"),    # Muon over several buckets
        "plain": (5, 7, False, None),     # Muon without tensor parallelism: replicated over tp
        "lm_head": (8, 11, False, "col"),  # AdamW: the output head, by name
    }

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed_tokens = nn.Embedding(11, 6)     # AdamW; ColwiseParallel: Shard(1)
        for name, (i, o, bias, _) in self.LINEARS.items():
            self.add_module(name, nn.Linear(i, o, bias=bias))
        self.norm = nn.LayerNorm(8)                 # AdamW; SequenceParallel: Replicate()
        self.norm2 = nn.LayerNorm(5)                # AdamW; no plan


def tp_plan() -> dict:
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel)
    plan = {"embed_tokens": ColwiseParallel(), "norm": SequenceParallel()}
    for name, (*_, style) in TPBag.LINEARS.items():
        if style:
            plan[name] = ColwiseParallel() if style == "col" else RowwiseParallel()
    return plan


def hsdp(mesh, seed: int = 0):
    """(model over a (replicate, shard) mesh, its unsharded twin)."""
    from torch.distributed.fsdp import fully_shard
    from helpers.zero_muon_harness import MIXED_SHAPES, Bag
    model = Bag(MIXED_SHAPES, seed)
    ref = copy.deepcopy(model)
    fully_shard(model, mesh=mesh)
    return model, ref


def fsdp_tp(mesh, seed: int = 0, dtype=torch.float32):
    """(model with tensor parallel over mesh["tp"] and FSDP2 over mesh["dp"], its fp32 twin);
    the model's parameters are ``dtype``, the twin starts from the same values."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    model = TPBag(seed).to(dtype)
    ref = copy.deepcopy(model).float()
    parallelize_module(model, mesh["tp"], tp_plan())
    fully_shard(model, mesh=mesh["dp"])
    return model, ref


def tp(mesh, seed: int = 0):
    """(model with tensor parallel alone over a 1-D mesh, the rest replicated, its twin)."""
    from torch.distributed.tensor import distribute_module
    from torch.distributed.tensor.parallel import parallelize_module
    model = TPBag(seed)
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh, tp_plan())
    for name in ("plain", "norm2"):      # no plan: every rank holds all of it
        distribute_module(getattr(model, name), mesh)
    return model, ref


def placements(model) -> dict[str, tuple]:
    """Parameter name -> its placements (``()`` for a plain tensor)."""
    from torch.distributed.tensor import DTensor
    return {n: tuple(p.placements) if isinstance(p, DTensor) else () for n, p in model.named_parameters()}
