"""Save a model and its ZeroMuon optimizer as one checkpoint generation (all ranks call it).

Each rank writes its own rows of every parameter and every optimizer state into flat zarr
arrays ``rank{r}/<key>`` (key: ``param``, ``momentum_buffer``, ``exp_avg``, ...; a
``.<dtype>`` suffix when not float32), one parameter at a time, so memory is bounded by the
largest local shard. Rank 0 writes the manifest (docs/format.md: global shapes, row blocks,
offsets, optimizer kinds, step, crc32c of every chunk) and commits: fsync, atomic rename of
``<gen>.partial`` to ``<gen>``, then ``latest``.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

from ..io import AsyncFileIO, IOFuture
from ..io.page_cache import sync_tree
from ..layout import FlatArray, create_group
from ..layout.dtypes import torch_to_zarr
from ..layout.metadata import fsync_dir
from ..optim.state_access import (adam_step, has_state, local_param, param_state_arrays,
                                  read_param_state)
from .checksums import file_crc32c
from .generations import FORMAT, FORMAT_VERSION, PARTIAL, generation_name, write_latest

CHUNK_BYTES = 64 << 20


def array_name(rank: int, key: str, dtype: torch.dtype) -> str:
    suffix = "" if dtype == torch.float32 else "." + torch_to_zarr(dtype)
    return f"rank{rank}/{key}{suffix}"


def _collective() -> tuple[int, int, bool]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), True
    return 0, 1, False


def _barrier(on: bool) -> None:
    if on:
        dist.barrier()


def param_name(info) -> str:
    return info.name or f"param.{info.index}"


@torch.no_grad()
def save_checkpoint(ckpt_dir: str, model: torch.nn.Module, optimizer, step: int, *,
                    chunk_bytes: int = CHUNK_BYTES) -> str:
    """Write generation ``step-<step>`` of ``optimizer``'s parameters and state under
    ``ckpt_dir``; collective over all ranks. Returns the committed directory.

    ``model`` is accepted for symmetry with ``load_checkpoint``: the optimizer's parameters
    are what is saved (buffers are not, yet).
    """
    rank, world, coll = _collective()
    opt = optimizer
    name = generation_name(step)
    final = os.path.join(ckpt_dir, name)
    staging = final + PARTIAL
    if rank == 0:
        if os.path.exists(final):
            raise FileExistsError(f"{final}: a checkpoint of step {step} is already committed")
        os.makedirs(ckpt_dir, exist_ok=True)
        if os.path.exists(staging):
            shutil.rmtree(staging)  # torn by an earlier crash: never loadable, safe to drop
        os.makedirs(staging)
    _barrier(coll)

    # -- plan: which parameter lands where in this rank's arrays --------------------------
    infos = [i for i in opt.infos if i.distributed or rank == 0]  # replicated: rank 0 only
    sizes: dict[str, tuple[torch.dtype, int]] = {}
    shards: dict[str, dict] = {}

    def place(key: str, dtype: torch.dtype, n: int) -> dict:
        arr = array_name(rank, key, dtype)
        dt, used = sizes.get(arr, (dtype, 0))
        sizes[arr] = (dtype, used + n)
        return {"array": arr, "offset": used}

    for info in infos:
        r = rank if info.distributed else 0
        n = info.local_numel(r)
        shard = {"rank": rank, "row_start": info.row_offset(r), "rows": info.rows_per_rank[r],
                 "numel": n, "param": place("param", info.dtype, n), "states": {}}
        if has_state(opt, info):
            for key, arr in param_state_arrays(opt, info).items():
                dtype = torch.float32 if key == "master_param" else opt.layout.chunks[
                    opt.layout.param_chunk[info.index]].state_dtype
                shard["states"][key] = place(key, dtype, n)
        shards[param_name(info)] = shard

    # -- write: one parameter at a time --------------------------------------------------
    create_group(os.path.join(staging, f"rank{rank}"), {})
    io = AsyncFileIO(threads=4, queue_depth=4)
    try:
        arrays = {arr: FlatArray.create(os.path.join(staging, arr), n, dt, io=io,
                                        chunk_bytes=chunk_bytes)
                  for arr, (dt, n) in sizes.items()}
        for info in infos:
            shard = shards[param_name(info)]
            pending: list[IOFuture] = []
            values = {"param": local_param(info).detach().reshape(-1).cpu()}
            for key in shard["states"]:
                values[key] = read_param_state(opt, info, key)
            for key, value in values.items():
                where = shard["param"] if key == "param" else shard["states"][key]
                arr = arrays[where["array"]]
                off = where["offset"]
                pending.append(arr.write_from(off, off + value.numel(), value.contiguous()))
            for f in pending:
                f.result()
        for arr in arrays.values():
            arr.sync().result()
        checksums = {name_: [file_crc32c(a.chunk_path(i)) for i in range(a.nchunks)
                             if os.path.exists(a.chunk_path(i))]
                     for name_, a in arrays.items()}
    finally:
        io.close()
    sync_tree(os.path.join(staging, f"rank{rank}"))

    # -- manifest and commit (rank 0) ----------------------------------------------------
    mine = {"shards": shards, "checksums": checksums,
            "arrays": {a: {"dtype": torch_to_zarr(dt), "numel": n} for a, (dt, n) in sizes.items()},
            "adam_steps": {param_name(i): adam_step(opt, i) for i in infos}}
    gathered = [None] * world
    if coll:
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if rank == 0:
        tensors = {}
        for info in opt.infos:
            pname = param_name(info)
            tensors[pname] = {
                "shape": list(info.shape), "dtype": torch_to_zarr(info.dtype),
                "optimizer": info.kind,
                "adam_step": next((g["adam_steps"][pname] for g in gathered
                                   if g["adam_steps"].get(pname) is not None), None),
                "shards": sorted((g["shards"][pname] for g in gathered if pname in g["shards"]),
                                 key=lambda s: s["rank"]),
            }
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
                   if k not in ("params", "param_names") and _jsonable(v)}
                  for g in opt.param_groups]
        attrs = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": step,
                 "world_size": world, "tensors": tensors, "param_groups": groups,
                 "arrays": {k: v for g in gathered for k, v in g["arrays"].items()},
                 "checksums": {k: v for g in gathered for k, v in g["checksums"].items()},
                 "committed": True}
        create_group(staging, attrs)
        fsync_dir(staging)
    _barrier(coll)
    if rank == 0:
        os.rename(staging, final)  # the commit point
        fsync_dir(ckpt_dir)
        write_latest(ckpt_dir, name)
    _barrier(coll)
    return final


def _jsonable(v) -> bool:
    return isinstance(v, (int, float, str, bool, type(None))) or (
        isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v))
