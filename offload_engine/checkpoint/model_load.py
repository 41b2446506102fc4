"""Weights into a model without an optimizer: each parameter's rows that this rank holds
(its FSDP2 block, or the whole tensor for a plain model), read from whichever saved shards
hold them, at any world size. Used for the parameters the optimizer does not hold (frozen
ones) on a resume, and for every parameter in a model-only load (evaluation, inference,
fine-tuning from a checkpoint).

A model parameter is found under any of its names (tied names included), directly or
through the checkpoint's recorded aliases. Its value is the saved ``param`` in the model's
dtype, or the fp32 master (``master_param``) when the model is float32 and the run kept
masters of lower-precision parameters.
"""

from __future__ import annotations

import logging
import math

import torch

from .. import dtypes
from ..formats.errors import CheckpointError
from ..formats.ours import OursSource
from ..formats.source import ReadRequest, TensorMeta
from .model_tensors import local_rows, model_parameters, row_block

log = logging.getLogger(__name__)


def read_into(src: OursSource, name: str, state: str, start: int, target: torch.Tensor) -> None:
    """Elements ``[start, start + target.numel())`` of ``name``'s ``state`` into
    ``target``: directly where it is a contiguous CPU tensor, else through a CPU copy."""
    fill(src, target, lambda out: [ReadRequest(name, start, out, state)])


def fill(src: OursSource, target: torch.Tensor, requests) -> None:
    """Read ``requests(out)`` (the reads that fill the flat CPU tensor ``out``) into
    ``target``: ``out`` is ``target`` itself where it is a contiguous 1-D CPU tensor, else a
    CPU tensor of its size that is copied into it afterwards."""
    if target.device.type == "cpu" and target.is_contiguous() and target.dim() == 1:
        src.read(requests(target))
        return
    staged = torch.empty(target.numel(), dtype=target.dtype)
    src.read(requests(staged))
    target.copy_(staged.view(target.shape).to(target.device))


def _find(tensors: dict[str, TensorMeta], aliases: dict[str, str], names: list[str]):
    for name in names:
        meta = tensors.get(name) or tensors.get(aliases.get(name, ""))
        if meta is not None:
            return meta
    return None


def _state_for(meta: TensorMeta, dtype: torch.dtype, gen: str, name: str) -> str:
    mine = dtypes.dtype(dtype)
    if "param" in meta.states and meta.states["param"].dtype == mine:
        return "param"
    if "master_param" in meta.states and meta.states["master_param"].dtype == mine:
        return "master_param"
    raise CheckpointError(f"{gen}: parameter {name} is {meta.dtype} in the checkpoint but {mine} "
                          f"in the model (saved states: {', '.join(meta.states)})")


@torch.no_grad()
def load_model_tensors(src: OursSource, model: torch.nn.Module, skip: set[int] = frozenset(),
                       strict: bool = True) -> None:
    """Every parameter of ``model`` but those whose id is in ``skip`` (the optimizer's,
    loaded with their state), this rank's rows, from ``src``. ``strict``: every parameter
    of the checkpoint must be one of the model's and every one of the model's in the
    checkpoint (else those both have are loaded). CheckpointError naming the generation
    and the parameter for a missing one or another shape or dtype."""
    gen = src.group
    tensors = {t.name: t for t in src.tensors() if t.kind in ("param", "frozen")}
    aliases = src.aliases()
    frozen_saved = src.manifest.extra.get("frozen_saved") is True
    found = set()
    for names, p in model_parameters(model):
        meta = _find(tensors, aliases, names)
        if meta is not None:
            found.add(meta.name)
        if id(p) in skip:
            continue
        if meta is None:
            if not strict and not skip:
                continue
            if skip and not frozen_saved:  # written before frozen parameters were saved
                log.warning("%s: saved without the parameters outside the optimizer; %s keeps "
                            "its values", gen, names[0])
                continue
            raise CheckpointError(f"{gen}: the checkpoint has no parameter {names[0]!r}"
                                  + (f" (nor {', '.join(names[1:])})" if names[1:] else ""))
        if meta.shape != tuple(p.shape):
            raise CheckpointError(f"{gen}: parameter {names[0]} is {list(meta.shape)} in the "
                                  f"checkpoint but {list(p.shape)} in the model")
        state = _state_for(meta, p.dtype, gen, names[0])
        block = row_block(p, names[0])
        row_numel = math.prod(p.shape[1:])
        read_into(src, meta.name, state, block.start * row_numel, local_rows(p).reshape(-1)
                  if local_rows(p).is_contiguous() else local_rows(p))
    if strict:
        unused = sorted(set(tensors) - found)
        if unused:
            raise CheckpointError(f"{gen}: the checkpoint's parameter {unused[0]!r} is not in the "
                                  f"model ({len(unused)} in all); pass strict=False to ignore them")
