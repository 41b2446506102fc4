"""Save a model and its ZeroMuon optimizer as one checkpoint generation (all ranks call it).

Each rank writes its own rows of every parameter and every optimizer state into flat zarr
arrays ``rank{r}/<key>`` (key: ``param``, ``momentum_buffer``, ``exp_avg``, ...; a
``.<dtype>`` suffix when not float32), one parameter at a time, so memory is bounded by the
largest local shard, then its shard table (where its rows of every parameter sit) in the
attributes of group ``rank{r}``. Rank 0 writes the tensor table (global shapes, dtypes,
optimizer kinds, states, step, crc32c of every chunk: docs/format.md, "Manifest") and
commits: fsync, atomic rename of ``<gen>.partial`` to ``<gen>``, then ``latest``. Only
small per-rank summaries travel between ranks (arrays, checksums, AdamW steps), never the
shard tables.
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
from ..layout.manifest import rank_group, shard_entry, tensor_entry, write_shard_table
from ..layout.metadata import fsync_dir
from ..optim.state_access import (adam_step, has_state, local_param, param_state_arrays,
                                  read_param_state)
from .checksums import chunk_checksums
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

    def place(key: str, dtype: torch.dtype, n: int) -> tuple[str, int]:
        arr = array_name(rank, key, dtype)
        dt, used = sizes.get(arr, (dtype, 0))
        sizes[arr] = (dtype, used + n)
        return arr, used

    for info in infos:
        r = rank if info.distributed else 0
        n = info.local_numel(r)
        states = {key: place(key, dt, n) for key, dt in saved_states(opt, info).items()}
        shards[param_name(info)] = shard_entry(info.row_offset(r), info.rows_per_rank[r], n,
                                               states)

    # -- write: one parameter at a time, then this rank's shard table ----------------------
    rank_dir = os.path.join(staging, rank_group(rank))
    create_group(rank_dir, {})
    io = AsyncFileIO(threads=4, queue_depth=4)
    try:
        arrays = {arr: FlatArray.create(os.path.join(staging, arr), n, dt, io=io,
                                        chunk_bytes=chunk_bytes)
                  for arr, (dt, n) in sizes.items()}
        for info in infos:
            states = shards[param_name(info)]["states"]
            pending: list[tuple[IOFuture, torch.Tensor]] = []  # a source lives until written
            for key, where in states.items():
                value = (local_param(info).detach().reshape(-1).cpu() if key == "param"
                         else read_param_state(opt, info, key)).contiguous()
                off = where["offset"]
                pending.append((arrays[where["array"]].write_from(off, off + value.numel(), value),
                                value))
            for f, _ in pending:
                f.result()
        for arr in arrays.values():
            arr.sync().result()
        checksums = {name_: chunk_checksums(a) for name_, a in arrays.items()}
    finally:
        io.close()
    write_shard_table(staging, rank, shards)
    sync_tree(rank_dir)

    # -- tensor table and commit (rank 0) --------------------------------------------------
    steps = {param_name(i): adam_step(opt, i) for i in infos}
    mine = {"checksums": checksums,
            "arrays": {a: {"dtype": torch_to_zarr(dt), "numel": n} for a, (dt, n) in sizes.items()},
            "adam_steps": {k: v for k, v in steps.items() if v is not None}}
    gathered = [None] * world
    if coll:
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if rank == 0:
        adam_steps = {k: v for g in reversed(gathered) for k, v in g["adam_steps"].items()}
        tensors = {}
        for info in opt.infos:
            pname = param_name(info)
            held = info.rows_per_rank if info.distributed else [info.rows] + [0] * (world - 1)
            tensors[pname] = tensor_entry(
                info.shape, torch_to_zarr(info.dtype), info.kind,
                {k: torch_to_zarr(dt) for k, dt in saved_states(opt, info).items()}, held, world)
            if pname in adam_steps:
                tensors[pname]["adam_step"] = adam_steps[pname]
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


def saved_states(opt, info) -> dict[str, torch.dtype]:
    """``{key: dtype}`` of what is saved for parameter ``info``: ``param`` and, once it has
    optimizer state, every state key (``master_param`` is float32, the others the state
    dtype of its chunk)."""
    out = {"param": info.dtype}
    if has_state(opt, info):
        state_dtype = opt.layout.chunks[opt.layout.param_chunk[info.index]].state_dtype
        for key in param_state_arrays(opt, info):
            out[key] = torch.float32 if key == "master_param" else state_dtype
    return out


def _jsonable(v) -> bool:
    return isinstance(v, (int, float, str, bool, type(None))) or (
        isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v))
