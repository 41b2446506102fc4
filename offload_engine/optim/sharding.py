"""How each parameter is split across ranks: DTensors on a 1-D or 2-D mesh, or plain tensors.

A DTensor parameter leaves each rank one box of the global tensor (``boxes.py``): FSDP2's
``Shard(0)`` a block of rows, HSDP's ``(Replicate(), Shard(0))`` the same block on every
replica, FSDP + tensor parallel a block of rows (``ColwiseParallel``) or a rectangle
(``RowwiseParallel``), a replicated parameter all of it. torch computes the box from the
placements (``compute_local_shape_and_global_offset``, the function DTensor itself uses);
``to_local()`` is that box, row-major, possibly empty. A plain tensor is held whole by
this process.

The exchange runs over one process group: that of the mesh every DTensor parameter lives
on, or of the largest one when FSDP2 put some parameters on a sub-mesh (a module without
tensor parallelism is sharded over the data-parallel dimension only). The boxes every rank
holds are exchanged once, at construction, so the owner of a matrix knows where each piece
comes from.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from .boxes import Box, check_tiling, row_counts
from .params import ParamInfo
from ..errors import InputError

try:
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor, Partial, compute_local_shape_and_global_offset = (), None, None


def is_dtensor(t) -> bool:
    return bool(DTensor) and isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this process holds (a view: in-place updates reach the parameter)."""
    return t.to_local() if is_dtensor(t) else t


def flat_local(t: torch.Tensor, what: str) -> torch.Tensor:
    loc = local_tensor(t)
    if not loc.is_contiguous():
        raise InputError(f"{what}: the local tensor is not contiguous (strides {loc.stride()}); "
                         "ZeroMuon updates parameters in place as flat element ranges")
    return loc.view(-1)


def placement_of(p) -> str:
    """How ``p`` is split, for messages: placements and mesh shape, or "plain"."""
    if not is_dtensor(p):
        return "plain tensor"
    mesh = "x".join(map(str, p.device_mesh.shape))
    return f"{tuple(p.placements)} on a {mesh} mesh"


def check_grad(p, grad, what: str) -> None:
    """A DTensor gradient must be split like its parameter (FSDP2 and tensor parallelism
    give it so); the step updates the local tensors element by element."""
    if not is_dtensor(p):
        return
    if not is_dtensor(grad) or tuple(grad.placements) != tuple(p.placements) \
            or grad.device_mesh != p.device_mesh:
        got = placement_of(grad) if is_dtensor(grad) else "a plain tensor"
        raise InputError(f"{what}: the gradient is {got}, the parameter {placement_of(p)}; "
                         "redistribute the gradient to the parameter's placements before step()")


def _ranks(mesh) -> set[int]:
    return set(mesh.mesh.flatten().tolist())


def exchange_group(infos: list[ParamInfo]):
    """The process group the Muon exchange runs over (None if no parameter is a DTensor).

    All DTensor parameters must live on one mesh, or on sub-meshes of the largest one (whose
    ranks include theirs). A 1-D mesh's own group is used; a 2-D mesh's ranks are the whole
    world's (the default group) or a flattened mesh (it needs ``mesh_dim_names``)."""
    meshes = []
    for info in infos:
        p = info.param
        if not is_dtensor(p):
            continue
        if any(isinstance(pl, Partial) for pl in p.placements):
            raise InputError(f"parameter {info.name or info.index} has placements "
                             f"{tuple(p.placements)}: a Partial parameter (a sum still to be "
                             "reduced) has no values to optimize")
        if p.device_mesh not in meshes:
            meshes.append(p.device_mesh)
    if not meshes:
        return None
    mesh = max(meshes, key=lambda m: m.size())   # the first of the largest: the same on every rank
    for m in meshes:
        if not _ranks(m) <= _ranks(mesh):
            raise InputError(f"DTensor parameters on device meshes {m} and {mesh}: all must be "
                             "on one mesh or on sub-meshes of the largest (ZeroMuon exchanges "
                             "over one process group)")
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    if not mesh.mesh_dim_names:
        raise InputError(f"DTensor parameters on {mesh}, a {mesh.ndim}-D mesh over part of the "
                         "world: give it mesh_dim_names so that ZeroMuon can flatten it into one "
                         "process group")
    return mesh._flatten().get_group()


def _local_box(p) -> tuple[list[int], list[int]]:
    """(global offset, local shape) of this rank's box of DTensor ``p``."""
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    loc = tuple(p.to_local().shape)
    if tuple(shape) != loc:
        raise InputError(f"DTensor parameter of shape {tuple(p.shape)} ({placement_of(p)}): its "
                         f"local tensor is {loc}, its placements say {tuple(shape)}")
    return list(offset), list(shape)


def name_hash(name: str | None) -> int:
    """A parameter name as an int64 every rank computes alike (0: no name)."""
    return zlib.crc32(name.encode()) + 1 if name else 0


def check_same_tensors(dist_infos, theirs: list[int], mine: list[int], r: int, rank: int) -> None:
    """Every rank's DTensor parameter j must be the same tensor (its boxes tile one tensor):
    refuse parameters named differently on two ranks, such as per-expert Linear layers that
    each expert-parallel rank holds its own of and shards with FSDP over a sub-mesh, which
    would otherwise be taken for replicas of one tensor."""
    for info, a, b in zip(dist_infos, theirs, mine):
        if a and b and a != b:
            raise InputError(
                f"DTensor parameter {info.name} of rank {rank} is another parameter on rank {r} "
                "(names differ at the same position): ZeroMuon needs each DTensor parameter on "
                "every rank of its exchange group. Per-expert Linear layers that differ between "
                "expert-parallel ranks can be plain tensors (each rank orthogonalizes its own), "
                "or a 3-D stack sharded Shard(0) on the expert-parallel mesh (docs/optimizer.md, "
                "Mixture of experts)")


def describe(infos: list[ParamInfo], group, world: int, rank: int, extra: list[int]) -> None:
    """Fill in what every rank holds of every parameter: one all_gather of the boxes at
    construction, never in a step. A row split (FSDP2 ``Shard(0)`` on a 1-D mesh) becomes
    ``rows_per_rank``, anything else ``boxes``; a plain tensor is held whole.

    ``extra`` is a short list of ints every rank must agree on (settings that decide the
    chunking and walking order); a disagreement raises instead of deadlocking later.
    """
    for info in infos:
        info.placement = placement_of(info.param)
        if not info.distributed:
            info.rows_per_rank = [info.rows]
    dist_infos = [i for i in infos if i.distributed]
    if not dist_infos and world == 1:
        return
    local = []
    for i in dist_infos:
        offset, shape = _local_box(i.param)
        local += offset + shape
    names = [name_hash(i.name) for i in dist_infos]
    mine = torch.tensor(local + names + list(extra) + [len(dist_infos)], dtype=torch.int64)
    if world == 1:
        gathered = [mine]
    else:
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=group)
    n = len(local)
    for r, g in enumerate(gathered):
        if g.numel() != mine.numel() or int(g[-1]) != len(dist_infos):
            raise InputError(f"rank {r} has a different number of sharded parameters than rank {rank}")
        check_same_tensors(dist_infos, g[n:n + len(names)].tolist(), names, r, rank)
        if g[n + len(names):-1].tolist() != list(extra):
            raise InputError(f"rank {r} disagrees with rank {rank} on optimizer settings "
                             f"{g[n + len(names):-1].tolist()} vs {list(extra)} (e.g. the store's "
                             "alternate_order)")
    per_rank = [g[:n].tolist() for g in gathered]
    at = 0
    for info in dist_infos:
        d = len(info.shape)
        boxes = []
        for vals in per_rank:
            lo = vals[at:at + d]
            boxes.append(Box(tuple(lo), tuple(a + b for a, b in zip(lo, vals[at + d:at + 2 * d]))))
        at += 2 * d
        what = f"parameter {info.name or info.index} ({info.placement})"
        check_tiling(info.shape, boxes, what)
        rows = row_counts(info.shape, boxes)
        if rows is not None:
            info.rows_per_rank = rows
        else:
            info.boxes = boxes
