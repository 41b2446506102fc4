"""The model's parameters as a checkpoint sees them, beyond the optimizer's: parameters the
optimizer was not given (frozen: ``requires_grad=False``, or left out of its groups), tied
names (one parameter reachable under two names), and the row block each rank holds.

A frozen parameter is saved like an optimized one: as rows, each rank its own where it is
an FSDP2 DTensor (``Shard(0)``), rank 0 alone where it is a plain or replicated tensor.
Its tensor-table entry says ``"frozen": true`` (docs/format.md). Tied names are recorded
in the manifest's ``aliases`` ({alias: owner}): the owner is saved once, under the name the
optimizer knows it by (or its first name in the model), every other name is an alias.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layout.manifest import fsdp_rows
from ..optim.sharding import is_dtensor, local_tensor, placement_of


@dataclass
class RowBlock:
    """Rows ``[start, start + rows)`` of a parameter, held by this rank; ``distributed``:
    each rank holds its own block (else every rank holds it whole and rank 0 saves it)."""

    distributed: bool
    start: int
    rows: int


def row_block(t: torch.Tensor, name: str) -> RowBlock:
    """This rank's rows of parameter ``t`` (a DTensor or a plain tensor). NotImplementedError
    naming the parameter where its local part is not a block of whole rows (tensor
    parallel splits: a checkpoint records rows)."""
    rows = t.shape[0] if t.dim() else 1
    if not is_dtensor(t) or all(p.is_replicate() for p in t.placements):
        return RowBlock(False, 0, rows)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(shape[1:]) != tuple(t.shape[1:]) or any(offset[1:]):
        raise NotImplementedError(
            f"parameter {name} has placement {placement_of(t)}: a checkpoint of a parameter "
            "outside the optimizer needs each rank to hold whole rows (FSDP2's Shard(0))")
    return RowBlock(True, offset[0], shape[0])


def frozen_rows(t: torch.Tensor, name: str, rank: int, world: int) -> list[int]:
    """Rows each of ``world`` ranks saves of a frozen parameter: FSDP2's split for a
    DTensor (checked against this rank's own block), the whole tensor on rank 0 otherwise."""
    block = row_block(t, name)
    rows = t.shape[0] if t.dim() else 1
    if not block.distributed:
        return [rows] + [0] * (world - 1)
    split = fsdp_rows(rows, world)
    if (sum(split[:rank]), split[rank]) != (block.start, block.rows):
        raise NotImplementedError(
            f"parameter {name} ({placement_of(t)}): rank {rank} holds rows [{block.start}, "
            f"{block.start + block.rows}), not FSDP2's split over the {world} ranks; a checkpoint "
            "of a frozen parameter needs a 1-D mesh over every rank")
    return list(split)


def local_rows(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a view)."""
    return local_tensor(t)


def reshard_fsdp(model: torch.nn.Module | None) -> None:
    """Every FSDP2 module of ``model`` back to its sharded parameters (``FSDPModule.reshard``:
    local, no collective; the next forward gathers them again). After a forward with no
    backward (an evaluation) FSDP2's root keeps its own parameters unsharded, registered as
    plain whole tensors in place of the DTensors the optimizer holds: a save would take them
    for frozen tensors rank 0 holds whole, and a load would fill the DTensors while the next
    forward used the stale whole copies."""
    if model is None:
        return
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2: nothing can be unsharded
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def model_parameters(model: torch.nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """Every distinct parameter of ``model`` with all the names it is reachable by, in
    ``named_parameters`` order (the first name is the one ``state_dict`` keeps first)."""
    by_id: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), ([], p))[0].append(name)
    return list(by_id.values())


def frozen_parameters(model: torch.nn.Module | None, optimizer) -> list[tuple[str, torch.Tensor]]:
    """``[(name, parameter)]`` of the model's parameters the optimizer does not hold, under
    their first name."""
    if model is None:
        return []
    held = {id(i.param) for i in optimizer.infos} if optimizer is not None else set()
    return [(names[0], p) for names, p in model_parameters(model) if id(p) not in held]


def tied_aliases(model: torch.nn.Module | None, saved_name: dict[int, str]) -> dict[str, str]:
    """``{alias: owner}``: every model name of a parameter other than the name it is saved
    under (``saved_name``: id of the parameter -> its name in the checkpoint)."""
    if model is None:
        return {}
    saved = set(saved_name.values())
    out = {}
    for names, p in model_parameters(model):
        owner = saved_name.get(id(p))
        if owner is None:
            continue
        for name in names:
            if name != owner and name not in saved:
                out[name] = owner
    return out
