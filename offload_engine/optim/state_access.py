"""Per-parameter access to ZeroMuon's state for the checkpoint layer, one parameter at a
time (memory bounded by the largest local shard, never the whole state).

State keys are torch's: ``momentum_buffer`` (Muon, lerp convention), ``exp_avg``,
``exp_avg_sq``, ``max_exp_avg_sq`` (AdamW) and ``master_param``; each is one
``state_layout.StateKind``. Reads and writes go through the optimizer's state object
(``opt.optimizer_state``: ``optimizer_state.OptimizerState``) and its public methods.
"""

from __future__ import annotations

import torch

from .boxes import Box, first_copies, full_box, row_box, row_counts
from .params import ParamInfo
from .sharding import local_tensor
from .state_layout import ArrayKey


def param_state_arrays(opt, info: ParamInfo) -> dict[str, ArrayKey]:
    """``{torch state key: state array}`` for one parameter."""
    return {k.kind.state_key: k for k in opt.layout.bundle_of(info.index).keys}


def state_arrays(opt) -> dict[str, tuple[str, str, torch.dtype, int]]:
    """Every state array of this rank's layout: ``{layout name: (store array name, torch
    state key, torch dtype, numel)}``. A copy of a store array (a snapshot) holds parameter
    ``info``'s state ``key`` at ``state_offsets(opt, info)[key][1]``."""
    return {name: (opt.array_name(name), a.key.kind.state_key, a.dtype.torch, a.numel)
            for name, a in opt.layout.arrays.items()}


def saved_parts(info: ParamInfo, world: int) -> list[Box | None]:
    """What each of ``world`` ranks saves of ``info`` in a checkpoint: a box, or None.
    Every element is saved once: a plain tensor by rank 0, a row split by every rank (its
    rows, maybe none), boxes by the first rank holding each (HSDP: replica 0; the other
    replicas hold the same state and write nothing for it)."""
    if not info.distributed:
        return [full_box(info.shape)] + [None] * (world - 1)
    if info.boxes is None:
        return [info.box(r) for r in range(world)]
    return first_copies(info.boxes)


def saved_rows(info: ParamInfo, parts: list[Box | None]) -> list[int] | None:
    """The rows each rank saves where ``parts`` (``saved_parts``) are whole rows in rank
    order (FSDP2, a plain tensor, HSDP's replica 0, a replicated DTensor): the shard table
    then records rows, as for any 1-D run; None where it must record boxes."""
    if not info.distributed:
        return [info.rows] + [0] * (len(parts) - 1)
    if info.boxes is None:
        return list(info.rows_per_rank)
    return row_counts(info.shape, [row_box(info.shape, 0, 0) if b is None else b for b in parts])


def state_offsets(opt, info: ParamInfo) -> dict[str, tuple[str, int, int]]:
    """``{torch state key: (layout array name, first element, elements)}`` of this rank's
    rows of ``info`` in the store's flat arrays (contiguous: the packed layout)."""
    bundle = opt.layout.bundle_of(info.index)
    offset, numel = bundle.offsets[info.index], bundle.sizes[info.index]
    return {k.kind.state_key: (k.name, bundle.starts[k.name] + offset, numel) for k in bundle.keys}


def state_dtype(opt, info: ParamInfo, key: str) -> torch.dtype:
    """The torch dtype state ``key`` of ``info`` is kept in."""
    return param_state_arrays(opt, info)[key].dtype.torch


def write_param_state(opt, info: ParamInfo, key: str, flat: torch.Tensor) -> None:
    """Set this rank's rows of state ``key`` of ``info`` from a flat tensor."""
    akey = param_state_arrays(opt, info)[key]
    opt.optimizer_state.write(info, akey, flat.to(dtype=akey.dtype.torch, device=opt.device))


def adam_step(opt, info: ParamInfo) -> float | None:
    """The AdamW step count of ``info`` (None before its first step or for Muon)."""
    return opt.optimizer_state.step_count(info)


def mark_restored(opt, info: ParamInfo, step: float | None) -> None:
    """After every state of ``info`` was written: it has state now (and its AdamW step)."""
    if info.kind == "adamw" and step is not None:
        opt.optimizer_state.set_step_count(info, step)
    opt.optimizer_state.mark_initialized([info.index])


def set_steps_taken(opt, step: int) -> None:
    """After a checkpoint load: ``opt`` has taken ``step`` steps (the checkpoint's), so its
    next is ``step + 1`` and the step its store's manifest records at ``close`` (what
    ``inspect`` of the store shows) counts the steps before the resume too."""
    opt._steps_done = int(step)


def has_state(opt, info: ParamInfo) -> bool:
    """Whether ``info`` has state (it took a step or had state loaded)."""
    return opt.optimizer_state.initialized(info)


def held_box(info: ParamInfo, rank: int) -> Box:
    """The part of the global tensor ``rank`` holds (a plain tensor: all of it)."""
    return info.box(rank) if info.distributed else full_box(info.shape)


def local_param(info: ParamInfo) -> torch.Tensor:
    """This rank's rows of the parameter (a view: writing into it updates the model)."""
    return local_tensor(info.param)
