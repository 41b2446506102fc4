"""How each parameter is split across ranks: FSDP2 ``Shard(0)`` DTensors or plain tensors.

An FSDP2 parameter is a DTensor on a 1-D device mesh with placement ``Shard(0)``: rank r
holds a contiguous block of rows (torch.chunk sizes: ``ceil(rows/W)`` each, the last ones
short or empty). ``to_local()`` gives those rows, unpadded, possibly zero of them. A plain
tensor is held whole by this process. The rows every rank holds are exchanged once, at
construction, so the owner of a matrix knows where each block comes from.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .params import ParamInfo

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor, Shard = (), None


def is_dtensor(t) -> bool:
    return bool(DTensor) and isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this process holds (a view: in-place updates reach the parameter)."""
    return t.to_local() if is_dtensor(t) else t


def flat_local(t: torch.Tensor, what: str) -> torch.Tensor:
    loc = local_tensor(t)
    if not loc.is_contiguous():
        raise ValueError(f"{what}: the local tensor is not contiguous (strides {loc.stride()}); "
                         "ZeroMuon updates parameters in place as flat element ranges")
    return loc.view(-1)


def process_group_of(params: list[torch.Tensor]):
    """The one process group all DTensor parameters are sharded over (None if there are none)."""
    group, mesh_seen = None, None
    for p in params:
        if not is_dtensor(p):
            continue
        mesh = p.device_mesh
        if mesh.ndim != 1:
            raise ValueError(f"DTensor parameters on a {mesh.ndim}-D device mesh are not supported "
                             "(FSDP2 with a 1-D mesh is; HSDP is not)")
        if tuple(p.placements) != (Shard(0),):
            raise ValueError(f"DTensor parameter with placements {tuple(p.placements)}: only "
                             "Shard(0) (FSDP2's default) is supported")
        if mesh_seen is None:
            mesh_seen, group = mesh, mesh.get_group()
        elif mesh != mesh_seen:
            raise ValueError("all DTensor parameters must be sharded over the same device mesh")
    return group


def describe(infos: list[ParamInfo], group, world: int, rank: int, extra: list[int]) -> None:
    """Fill ``rows_per_rank`` of every parameter; exchange local row counts once (one
    all_gather at construction, never in a step).

    ``extra`` is a short list of ints every rank must agree on (settings that decide the
    chunking and walking order); a disagreement raises instead of deadlocking later.
    """
    for info in infos:
        if not info.distributed:
            info.rows_per_rank = [info.rows]
    dist_infos = [i for i in infos if i.distributed]
    if not dist_infos and world == 1:
        return
    local = [local_tensor(i.param).shape[0] if i.param.ndim else 1 for i in dist_infos]
    mine = torch.tensor(local + list(extra) + [len(dist_infos)], dtype=torch.int64)
    if world == 1:
        gathered = [mine]
    else:
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=group)
    n = len(dist_infos)
    for r, g in enumerate(gathered):
        if g.numel() != mine.numel() or int(g[-1]) != n:
            raise ValueError(f"rank {r} has a different number of sharded parameters than rank {rank}")
        if g[n:-1].tolist() != list(extra):
            raise ValueError(f"rank {r} disagrees with rank {rank} on optimizer settings "
                             f"{g[n:-1].tolist()} vs {list(extra)} (e.g. the store's alternate_order)")
    for j, info in enumerate(dist_infos):
        info.rows_per_rank = [int(g[j]) for g in gathered]
        if sum(info.rows_per_rank) != info.rows:
            raise ValueError(f"parameter {info.name or info.index}: local rows {info.rows_per_rank} "
                             f"do not add up to its {info.rows} rows")
