"""Load a checkpoint generation into a model and its ZeroMuon optimizer, at the world size
it was saved with or another one (all ranks call it).

Each rank computes the part it holds of every parameter from the *current* sharding (a
block of rows under FSDP2, a box on a 2-D mesh or under tensor parallel, all of a plain
tensor) and reads it through the one reader of our format (``formats.ours.OursSource``): it
parses the shard tables of the saved ranks that hold them (at the same world size, its own
and rank 0's) and verifies the crc32c of every chunk it reads. Parameters are written into
the model in place (straight into the parameter's memory where it is a contiguous CPU
tensor), one parameter at a time; state goes into the optimizer's store; every rank copies
the persistent buffers from rank 0's shard. Parameters the optimizer does not hold (frozen,
or every parameter of a model-only load) are read by ``model_load.py``; the per-rank
extra state and RNG states by ``training_state.py``.
"""

from __future__ import annotations

import os

import torch

from .. import dtypes
from ..formats.errors import CheckpointError
from ..errors import OffloadEngineError
from ..formats.ours import OursSource
from ..formats.ours.checkpoint_listing import find_generation, was_removed
from ..formats.source import ReadRequest
from ..layout.box_runs import box_runs
from ..optim.boxes import Box
from ..optim.state_access import (held_box, local_param, mark_restored, param_state_arrays,
                                  set_steps_taken, write_param_state)
from .buffers import persistent_buffers
from .model_load import fill, load_model_tensors, read_into as _read_into
from .model_tensors import reshard_fsdp
from .pending import finish_previous
from .save import _collective, param_name
from .supported import check_optimizer
from .training_state import restore_training_state
from ..units import MiB
from ..errors import InputError

WINDOW_BYTES = 8 * MiB  # bytes per checksummed read window


@torch.no_grad()
def load_checkpoint(ckpt_dir: str, model: torch.nn.Module | None = None, optimizer=None,
                    tag: str | None = None, *, extra: dict | None = None,
                    rng: bool | None = None, strict: bool = True) -> int:
    """Restore what generation ``tag`` of ``ckpt_dir`` (default: the one ``latest`` names)
    holds into what is passed; returns the step it was saved at. Collective: every rank
    calls it.

    - ``model`` and ``optimizer`` (a ZeroMuon): a resume. Parameters, optimizer state,
      frozen parameters, persistent buffers, and (``rng`` None or True) each rank's RNG
      states.
    - ``model`` alone: its weights (frozen ones too) and buffers, at any world size, into
      an FSDP2 or a plain model; ``strict``: every tensor of the checkpoint must be one of
      the model's.
    - ``optimizer`` alone: its state and hyperparameters; the parameters are left as they
      are.
    - ``extra``: ``{name: object}`` as saved: each gets its state back
      (``load_state_dict``; a dict is refilled in place).

    Raises CheckpointError (naming the file) for a missing, torn or corrupt checkpoint or
    one of another model; TypeError for an optimizer other than ZeroMuon."""
    opt = check_optimizer(optimizer, "load_checkpoint", allow_none=True)
    if model is None and opt is None:
        raise InputError("load_checkpoint: pass a model, an optimizer or both")
    if opt is not None:
        finish_previous(opt)  # a save in progress reads the parameters this overwrites
    if rng is None:
        rng = model is not None and opt is not None
    reshard_fsdp(model)  # fill the shards, not whole copies an evaluation left unsharded
    rank, _, _ = _collective()
    gen = find_generation(ckpt_dir, tag)
    try:
        # every rank checks the metadata files it reads; rank 0 checks all of them (one
        # reader: a damaged byte anywhere stops the load, and the tables are read once)
        with OursSource(gen, "checkpoint", generation=os.path.basename(os.path.normpath(gen)),
                        window_bytes=WINDOW_BYTES, depth=2, io_threads=4,
                        verify_all_metadata=rank == 0) as src:
            return _restore(src, model, opt, rank, extra, rng, strict)
    except (OffloadEngineError, OSError) as e:  # a keep_last racing this read: say so
        removed = was_removed(gen, e)
        if removed is None:
            raise
        raise removed from e


def _restore(src: OursSource, model, opt, rank: int, extra, rng: bool, strict: bool) -> int:
    """``load_checkpoint``'s reads from the open generation ``src``; returns its step."""
    buffers = _buffers_to_restore(src, model, strict or opt is not None)
    if opt is not None:
        _load_optimizer(src, opt, params=model is not None)
        set_steps_taken(opt, src.manifest.step)
    if model is not None:
        held = {id(i.param) for i in opt.infos} if opt is not None else set()
        load_model_tensors(src, model, skip=held, strict=strict and opt is None)
    for name, buf in buffers.items():  # whole on every rank, from rank 0's copy
        _read_into(src, name, "param", 0, buf.view(-1) if buf.is_contiguous() else buf)
    if extra or rng:
        restore_training_state(src, rank, extra, rng)
    return int(src.manifest.step)


def _load_optimizer(src: OursSource, opt, params: bool) -> None:
    """This rank's part (rows, or a box) of every parameter the optimizer holds (with
    ``params``) and of its state; the saved hyperparameters into its groups."""
    gen = src.group
    rank = _collective()[0]
    tensors = {t.name: t for t in src.tensors()}
    wanted = []  # (info, tensor meta, the part of it this rank holds)
    for info in opt.infos:
        pname = param_name(info)
        meta = tensors.get(pname)
        if meta is None:
            raise CheckpointError(f"{gen}: the checkpoint has no parameter {pname!r}")
        mine = dtypes.dtype(info.dtype)
        if meta.shape != tuple(info.shape) or meta.dtype != mine:
            raise CheckpointError(
                f"{gen}: parameter {pname} is {meta.dtype} {list(meta.shape)} in the "
                f"checkpoint but {mine} {list(info.shape)} in the model")
        wanted.append((info, meta, held_box(info, rank)))

    for info, meta, box in wanted:
        pname = param_name(info)
        if params:
            _read_box_into(src, pname, "param", meta.shape, box, local_param(info).view(-1))
        saved = [k for k in meta.states if k != "param"]
        if not saved:
            continue
        for key in param_state_arrays(opt, info):
            if key not in meta.states:
                raise CheckpointError(f"{gen}: parameter {pname} has no saved {key!r}")
            n = local_param(info).numel()
            value = torch.empty(n, dtype=meta.states[key].dtype.torch)
            src.read(_requests(pname, key, meta.shape, box, value))
            write_param_state(opt, info, key, value)
        mark_restored(opt, info, meta.extra.get("adam_step"))
    for saved, group in zip(src.manifest.extra.get("param_groups", []), opt.param_groups):
        for k, v in saved.items():
            if k in group and k != "use_muon":
                group[k] = tuple(v) if isinstance(group[k], tuple) else v


def _requests(name: str, state: str, shape, box: Box, out: torch.Tensor) -> list[ReadRequest]:
    """Reads of ``box`` of ``name``'s ``state`` (global ``shape``) into the flat CPU tensor
    ``out`` (row-major through the box, as the rank's local tensor holds it): one request
    per run of the box in the flattened tensor (one for a block of whole rows)."""
    return [ReadRequest(name, dest, out[at:at + n], state)
            for dest, at, n in box_runs(shape, box.lo, box.shape)]


def _read_box_into(src: OursSource, name: str, state: str, shape, box: Box,
                   target: torch.Tensor) -> None:
    """``box`` of ``name``'s ``state`` into ``target`` (the local tensor, or its flat view)."""
    fill(src, target, lambda out: _requests(name, state, shape, box, out))


def _buffers_to_restore(src: OursSource, model, strict: bool = True) -> dict[str, torch.Tensor]:
    """The model's persistent buffers, checked against those the checkpoint saved (none
    for a checkpoint written before buffers were saved, or without a model); not
    ``strict``: those both have, the others are left alone."""
    gen = src.group
    if model is None or not src.manifest.extra.get("buffers_saved"):
        return {}
    model_buffers = persistent_buffers(model)
    saved = {t.name: t for t in src.tensors() if t.kind == "buffer"}
    missing, extra = sorted(set(model_buffers) - set(saved)), sorted(set(saved) - set(model_buffers))
    if not strict:
        model_buffers = {k: v for k, v in model_buffers.items() if k in saved}
        missing = extra = []
    if missing:
        raise CheckpointError(f"{gen}: the checkpoint has no buffer {missing[0]!r} of the model")
    if extra:
        raise CheckpointError(f"{gen}: the checkpoint's buffer {extra[0]!r} is not in the model"
                              " (a model-only load ignores it with strict=False)")
    for name, buf in model_buffers.items():
        meta = saved[name]
        mine = dtypes.dtype(buf.dtype)
        if meta.shape != tuple(buf.shape) or meta.dtype != mine:
            raise CheckpointError(
                f"{gen}: buffer {name} is {meta.dtype} {list(meta.shape)} in the checkpoint "
                f"but {mine} {list(buf.shape)} in the model")
    return model_buffers


