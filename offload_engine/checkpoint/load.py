"""Load a checkpoint generation into a model and its ZeroMuon optimizer, at the world size
it was saved with or another one (all ranks call it).

Each rank computes its own row block of every parameter from the *current* sharding, reads
the shard tables of the saved ranks whose rows overlap it (the tensor table's row split
says which: at the same world size, its own and rank 0's), and reads those rows from the
saved shards (``row_start``, ``rows`` and offsets), one parameter at a time, verifying the
crc32c of every chunk it reads. Parameters are written into the model in place; state goes
into the optimizer's store; every rank copies the persistent buffers from rank 0's shard.
"""

from __future__ import annotations

import math
import os

import torch

from ..io import AsyncFileIO
from ..layout import FlatArray
from .. import dtypes
from ..layout.manifest import ranks_holding_rows, rows_per_rank, tensor_rows
from ..optim.state_access import local_param, mark_restored, param_state_arrays, write_param_state
from .buffers import persistent_buffers
from .checksums import ChunkVerifier
from .generations import CheckpointError, manifest, resolve, shard_tables
from .pending import finish_previous
from .save import _collective, param_name


@torch.no_grad()
def load_checkpoint(ckpt_dir: str, model: torch.nn.Module, optimizer, tag: str | None = None) -> int:
    """Restore parameters, persistent buffers and optimizer state from ``ckpt_dir`` (the
    ``latest`` generation, or ``tag``); returns the step it was saved at. Raises
    CheckpointError (naming the file) for a missing, torn or corrupt checkpoint or one of
    another model."""
    finish_previous(optimizer)  # a save in progress reads the parameters this overwrites
    gen = resolve(ckpt_dir, tag)
    attrs = manifest(gen)
    rank, _, _ = _collective()
    opt = optimizer
    tensors = attrs["tensors"]
    wanted = {}  # parameter name -> (info, its tensor table entry, rows [lo, lo + rows))
    needed: set[int] = set()
    for info in opt.infos:
        pname = param_name(info)
        entry = tensors.get(pname)
        if entry is None:
            raise CheckpointError(f"{gen}: the checkpoint has no parameter {pname!r}")
        if tuple(entry["shape"]) != info.shape or entry["dtype"] != dtypes.dtype(info.dtype).name:
            raise CheckpointError(
                f"{gen}: parameter {pname} is {entry['dtype']} {entry['shape']} in the "
                f"checkpoint but {dtypes.dtype(info.dtype).name} {list(info.shape)} in the model")
        r = rank if info.distributed else 0
        lo, rows = info.row_offset(r), info.rows_per_rank[r]
        wanted[pname] = (info, entry, lo, rows)
        needed.update(ranks_holding_rows(rows_per_rank(entry, attrs["world_size"]), lo, lo + rows))
    buffers = _buffers_to_restore(gen, attrs, model)
    if buffers:
        needed.add(0)
    shards = shard_tables(gen, sorted(needed))
    verifier = ChunkVerifier(gen, attrs["checksums"])
    io = AsyncFileIO(threads=4, queue_depth=4)
    arrays: dict[str, FlatArray] = {}

    def array(name: str) -> FlatArray:
        if name not in arrays:
            path = os.path.join(gen, name)
            try:
                arrays[name] = FlatArray.open(path, io=io, mode="r")
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{path}: cannot open: {e}") from None
        return arrays[name]

    def gather(pname: str, pieces, lo: int, rows: int, row_numel: int, key: str,
               dtype: torch.dtype) -> torch.Tensor:
        """Rows [lo, lo + rows) of state ``key`` of tensor ``pname`` from the saved shards
        ``pieces`` ([(saved rank, shard entry)]), flat, verified chunk by chunk."""
        rn = row_numel
        out = torch.empty(rows * rn, dtype=dtype)
        covered = 0
        for srank, sh in pieces:
            a, b = max(lo, sh["row_start"]), min(lo + rows, sh["row_start"] + sh["rows"])
            if a >= b:
                continue
            where = sh["states"].get(key)
            if where is None:
                raise CheckpointError(f"{gen}: shard of rank {srank} of {pname} has no {key!r}")
            flat = array(where["array"])
            if flat.dtype != dtype:
                raise CheckpointError(f"{flat.path}: holds {flat.dtype}, expected {dtype}")
            start = where["offset"] + (a - sh["row_start"]) * rn
            stop = start + (b - a) * rn
            verifier.verify(where["array"], flat, start, stop)
            flat.read_into(start, stop, out[(a - lo) * rn:(b - lo) * rn]).result()
            covered += (b - a) * rn
        if covered != rows * rn:
            raise CheckpointError(f"{gen}: the saved shards of {pname} cover {covered} of "
                                  f"the {rows * rn} elements this rank needs (missing rank?)")
        return out

    try:
        for pname, (info, entry, lo, rows) in wanted.items():
            pieces = shards.get(pname, [])
            param = local_param(info)
            param.view(-1).copy_(gather(pname, pieces, lo, rows, info.row_numel, "param",
                                        info.dtype).to(param.device))
            saved_states = {k: v for k, v in entry["states"].items() if k != "param"}
            if not saved_states:
                continue
            for key in param_state_arrays(opt, info):
                if key not in saved_states:
                    raise CheckpointError(f"{gen}: parameter {pname} has no saved {key!r}")
                write_param_state(opt, info, key, gather(pname, pieces, lo, rows, info.row_numel,
                                                         key, dtypes.zarr_dtype(saved_states[key]).torch))
            mark_restored(opt, info, entry.get("adam_step"))
        for name, buf in buffers.items():  # whole on every rank, from rank 0's copy
            row_numel = math.prod(buf.shape[1:])
            value = gather(name, shards.get(name, []), 0, tensor_rows(buf.shape), row_numel,
                           "param", buf.dtype)
            buf.copy_(value.view(buf.shape).to(buf.device))
        for saved, group in zip(attrs.get("param_groups", []), opt.param_groups):
            for k, v in saved.items():
                if k in group and k != "use_muon":
                    group[k] = tuple(v) if isinstance(group[k], tuple) else v
    finally:
        io.close()
    return int(attrs["step"])


def _buffers_to_restore(gen: str, attrs: dict, model) -> dict[str, torch.Tensor]:
    """The model's persistent buffers, checked against those the checkpoint saved (none
    for a checkpoint written before buffers were saved, or without a model)."""
    if model is None or not attrs.get("buffers_saved"):
        return {}
    tensors = attrs["tensors"]
    model_buffers = persistent_buffers(model)
    saved = {n for n, e in tensors.items() if e.get("buffer")}
    missing, extra = sorted(set(model_buffers) - saved), sorted(saved - set(model_buffers))
    if missing:
        raise CheckpointError(f"{gen}: the checkpoint has no buffer {missing[0]!r} of the model")
    if extra:
        raise CheckpointError(f"{gen}: the checkpoint's buffer {extra[0]!r} is not in the model")
    for name, buf in model_buffers.items():
        entry = tensors[name]
        if tuple(entry["shape"]) != tuple(buf.shape) or entry["dtype"] != dtypes.dtype(buf.dtype).name:
            raise CheckpointError(
                f"{gen}: buffer {name} is {entry['dtype']} {entry['shape']} in the checkpoint "
                f"but {dtypes.dtype(buf.dtype).name} {list(buf.shape)} in the model")
    return model_buffers
