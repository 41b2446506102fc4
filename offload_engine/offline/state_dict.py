"""Python drop-ins for DeepSpeed's ``zero_to_fp32`` functions, over every format we read.

Each takes a checkpoint folder (ours, or DeepSpeed ZeRO-1/2/3; a tag folder; or
safetensors) and does what DeepSpeed's function of the same purpose does, without
``import deepspeed`` and without unpickling anything but tensor metadata:

=================================================  =========================================
DeepSpeed (``deepspeed.utils.zero_to_fp32``)       here (``offload_engine.consolidate``)
=================================================  =========================================
``get_fp32_state_dict_from_zero_checkpoint``       ``get_fp32_state_dict``
``convert_zero_checkpoint_to_fp32_state_dict``     ``convert_to_safetensors``
``load_state_dict_from_zero_checkpoint``           ``load_state_dict_from_checkpoint``
=================================================  =========================================

The values are those ``consolidate`` writes (``offline.consolidate.written_tensors``): a
DeepSpeed run's fp32 masters, else the parameter; float tensors as float32, integer and
bool buffers bit for bit. Tied names share their owner's tensor, as in DeepSpeed's dict.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator, Mapping

from ..dtypes import FLOAT32
from ..formats import FormatError, ReadRequest, TensorSource, open_source
from .consolidate import (ConsolidateResult, Written, consolidate, output_dtype,
                          written_aliases, written_tensors)
from .hf_extras import copy_extras, find_extras
from .hf_shards import parse_size
from ..errors import InputError, UsageError

log = logging.getLogger(__name__)


def open_weights(path: str, tag: str | None = None) -> TensorSource:
    """Open ``path`` (``tag``: a generation or DeepSpeed tag instead of ``latest``'s) as a
    source of model weights. A live store directory holds optimizer state only: refused."""
    source = open_source(path, tag)
    if source.info.kind == "store":
        source.close()
        raise FormatError(f"{path}: a live store directory holds optimizer state, not the "
                          f"model's weights; pass a checkpoint (save_checkpoint)")
    return source


def read_value(source: TensorSource, info: Written, dtype=FLOAT32, start_row: int = 0,
               rows: int | None = None):
    """Tensor ``info`` (rows ``[start_row, start_row + rows)`` of its first dimension, all
    by default) as a new CPU torch tensor: floats cast to ``dtype`` (round to nearest even
    when narrowing), other dtypes as stored. Memory: the tensor (twice while a float of
    another width is cast)."""
    import torch

    shape = list(info.shape)
    row_numel = 1
    for n in shape[1:]:
        row_numel *= n
    if rows is not None:
        shape[0] = rows
    stored = torch.empty(shape, dtype=info.dtype.torch)
    if stored.numel():
        source.read([ReadRequest(info.name, start_row * row_numel, stored.view(-1), info.state)])
    wanted = output_dtype(info, dtype).torch
    return stored if stored.dtype == wanted else stored.to(wanted)


def get_fp32_state_dict(path: str, tag: str | None = None, exclude_frozen: bool = False,
                        lazy: bool = False, *, exclude_frozen_parameters: bool | None = None,
                        lazy_mode: bool | None = None) -> dict | "LazyStateDict":
    """Every weight of the checkpoint at ``path`` as ``{name: CPU tensor}``, in the
    checkpoint's order, tied names last and sharing their owner's tensor.

    ``tag``: the generation or DeepSpeed tag to read (default: the one ``latest`` names).
    ``exclude_frozen``: leave out parameters that had ``requires_grad=False``.
    ``lazy``: return a ``LazyStateDict`` instead, which reads a tensor each time it is
    looked up (memory: one tensor; close it, or use it as a context manager).
    ``exclude_frozen_parameters``, ``lazy_mode``: DeepSpeed's spellings of the two, also
    accepted (``get_fp32_state_dict_from_zero_checkpoint`` is DeepSpeed's function itself)."""
    exclude_frozen = _either("exclude_frozen", exclude_frozen, exclude_frozen_parameters)
    lazy = _either("lazy", lazy, lazy_mode)
    source = open_weights(path, tag)
    if lazy:
        return LazyStateDict(source, exclude_frozen)
    with source:
        out = {w.name: read_value(source, w) for w in written_tensors(source, exclude_frozen)}
        for alias, owner in written_aliases(source, exclude_frozen).items():
            out[alias] = out[owner]
    return out


def _either(name: str, ours: bool, deepspeeds: bool | None) -> bool:
    """A flag given under our name or DeepSpeed's; UsageError when both disagree."""
    if deepspeeds is None:
        return ours
    if ours and not deepspeeds:
        raise UsageError(f"{name}=True contradicts its DeepSpeed spelling set to False")
    return bool(deepspeeds)


class LazyStateDict(Mapping):
    """A read-only ``{name: tensor}`` view of a checkpoint whose tensors are read from disk
    on each look-up and not kept: iterating it to save or compare holds one tensor at a
    time. The checkpoint stays open until ``close()`` (or the end of a ``with`` block, or
    garbage collection)."""

    def __init__(self, source: TensorSource, exclude_frozen: bool = False):
        self._source = source
        self._tensors = {w.name: w for w in written_tensors(source, exclude_frozen)}
        self._aliases = written_aliases(source, exclude_frozen)
        self._closer = weakref.finalize(self, source.close)

    def __getitem__(self, name: str):
        info = self._tensors.get(name) or self._tensors.get(self._aliases.get(name, ""))
        if info is None:
            raise KeyError(name)
        if not self._closer.alive:
            raise InputError(f"{self._source.info.path}: read of {name!r} after close()")
        return read_value(self._source, info)

    def __iter__(self) -> Iterator[str]:
        yield from self._tensors
        yield from self._aliases

    def __len__(self) -> int:
        return len(self._tensors) + len(self._aliases)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name`` (elements per dimension), from metadata only."""
        info = self._tensors.get(name) or self._tensors[self._aliases[name]]
        return info.shape

    @property
    def aliases(self) -> dict[str, str]:
        """Tied names: ``{alias: owner}``."""
        return dict(self._aliases)

    def close(self) -> None:
        self._closer()

    def __enter__(self) -> "LazyStateDict":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def convert_to_safetensors(path: str, out: str, max_shard_size: int | str = "5GB",
                           tag: str | None = None, exclude_frozen: bool = False,
                           dtype: str = "fp32", copy_config: bool = True) -> ConsolidateResult:
    """Write the checkpoint at ``path`` to folder ``out`` as Hugging Face safetensors
    (``model.safetensors``, or shards of at most ``max_shard_size`` bytes, "5GB" counting
    in powers of ten as Hugging Face does, plus ``model.safetensors.index.json``), streaming
    with memory independent of the model's size: what ``offload-engine consolidate`` does.
    Tied names are written once and recorded as aliases. ``copy_config``: also copy
    config.json, generation_config.json and tokenizer files found beside the checkpoint
    (``hf_extras``), so ``from_pretrained(out)`` works. Returns what was written."""
    with open_weights(path, tag) as source:
        result = consolidate(source, out, max_shard_bytes=parse_size(max_shard_size),
                             dtype=dtype, exclude_frozen=exclude_frozen)
    if copy_config:
        result.files.extend(copy_extras(find_extras(path), out))
    return result


def load_state_dict_from_checkpoint(model, path: str, tag: str | None = None,
                                    strict: bool = True):
    """Copy the checkpoint's weights into ``model`` in place and return it: a plain module
    (on any device) or one sharded by FSDP2 / DTensor (each rank reads only its own part
    where its part is a block of rows). Values are cast to each tensor's dtype.

    ``strict``: every parameter and persistent buffer of the model must be in the
    checkpoint and the reverse (FormatError naming them); otherwise the missing and the
    unexpected are logged and left alone. Shapes must match in both cases. Memory: one
    tensor (one rank's rows of it, for a sharded model)."""
    import torch

    targets = model.state_dict(keep_vars=True)
    with open_weights(path, tag) as source:
        infos = {w.name: w for w in written_tensors(source)}
        for alias, owner in written_aliases(source).items():
            infos[alias] = infos[owner]
        missing = [k for k in targets if k not in infos]
        unexpected = [k for k in infos if k not in targets]
        if missing or unexpected:
            what = "; ".join(part for part in (
                _listed("missing from the checkpoint", missing),
                _listed("in the checkpoint but not in the model", unexpected)) if part)
            if strict:
                raise FormatError(f"{source.describe()}: {what} (strict=False loads the rest)")
            log.warning("%s: %s", source.describe(), what)
        for name, target in targets.items():  # all checked before anything is copied
            if name in infos and tuple(target.shape) != tuple(infos[name].shape):
                raise FormatError(f"{source.info.path}: {name} is {list(infos[name].shape)} in "
                                  f"the checkpoint but {list(target.shape)} in the model")
        with torch.no_grad():
            for name, target in targets.items():
                if name in infos:
                    _load_one(source, infos[name], target)
    return model


def _listed(what: str, names: list[str], most: int = 8) -> str:
    if not names:
        return ""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return f"{what}: {', '.join(names[:most])}{more}"


def _load_one(source: TensorSource, info: Written, target) -> None:
    """Fill ``target`` (a tensor, parameter or DTensor of global shape ``info.shape``)."""
    local, offset = _local_part(target)
    if local.numel() == 0:
        return
    full_rows = all(o == 0 for o in offset[1:]) and tuple(local.shape[1:]) == info.shape[1:]
    if local.dim() and full_rows:  # a block of whole rows: read just those
        value = read_value(source, info, start_row=offset[0], rows=local.shape[0])
    else:
        value = read_value(source, info)
        value = value[tuple(slice(o, o + n) for o, n in zip(offset, local.shape))]
    local.copy_(value.reshape(local.shape))


def _local_part(target):
    """``(this rank's tensor, its offset in the global tensor per dimension)``."""
    from torch.distributed.tensor import DTensor

    if not isinstance(target, DTensor):
        return target.data, (0,) * target.dim()
    # The helper torch.distributed.checkpoint uses to place a rank's shard in the global
    # tensor: it knows every placement (Shard, uneven chunks, Replicate, 2-D meshes).
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        target.shape, target.device_mesh, target.placements)
    local = target.to_local()
    if tuple(local.shape) != tuple(shape):  # a padded local tensor: the real rows first
        local = local[tuple(slice(0, n) for n in shape)]
    return local, tuple(offset)
