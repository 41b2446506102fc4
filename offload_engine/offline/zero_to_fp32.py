"""DeepSpeed's ``zero_to_fp32`` Python API under its own names, signatures and outputs.

A script that imports these from ``deepspeed.utils.zero_to_fp32`` migrates by changing
its import line to ``offload_engine.consolidate``, keywords included, and then also reads
our checkpoints. What it gets is what DeepSpeed 0.19.8 gives (docs/consolidate.md, "Python API"):

- ``get_fp32_state_dict_from_zero_checkpoint``: a ``dict`` of CPU tensors in
  DeepSpeed's key order (buffers, frozen parameters, trainable parameters, tied names),
  floats as float32, integer and bool buffers bit for bit, trainable parameters with
  ``requires_grad=True`` (DeepSpeed's fp32 masters), a tied name holding its owner's
  tensor object. ``lazy_mode=True``: an ``OrderedDict`` of ``LazyTensor`` values that
  read the tensor from disk on ``.contiguous()`` (DeepSpeed's ``GatheredTensor``).
- ``convert_zero_checkpoint_to_fp32_state_dict`` / ``convert_zero_checkpoint_to_state_dict``:
  ``pytorch_model.bin`` (``torch.save``) or, with ``safe_serialization``, ``model.safetensors``;
  sharded as ``huggingface_hub`` splits (``pytorch_model-00001-of-0000N.bin`` plus
  ``pytorch_model.bin.index.json``), one shard in memory at a time as in DeepSpeed.
  Where DeepSpeed fails (``safe_serialization`` with tied weights) the tied name is left
  out of the file and recorded as ``{alias: owner}`` in its ``__metadata__``, as
  ``huggingface_hub.save_torch_state_dict`` does.
- ``load_state_dict_from_zero_checkpoint(model, dir)``: moves ``model`` to the CPU, loads
  non-strictly and returns it.

Differences kept on purpose: ZeRO-1 frozen parameters are included (DeepSpeed drops them:
ZeRO-1 records no frozen shapes) and every float tensor of the state dict is float32
(DeepSpeed leaves ZeRO-1/2 frozen parameters in the run's 16-bit dtype). Nothing is
printed; progress goes to the ``offload_engine`` logger.
"""

from __future__ import annotations

import json
import logging
import os
import weakref
from collections import OrderedDict

from ..dtypes import FLOAT32, dtype as as_dtype
from ..formats import TensorSource
from ..errors import InputError
from ..io.errors import WrappedIOError
from .consolidate import Written, output_dtype, written_aliases, written_tensors
from .hf_shards import OutTensor, parse_size, split_shards
from .state_dict import open_weights, read_value

log = logging.getLogger(__name__)

_OUTPUT_DTYPES = ("float32", "fp32", "float16", "fp16", "bfloat16", "bf16")


class LazyTensor:
    """A tensor not read yet: ``shape``, ``dtype`` (as it will be returned) and
    ``contiguous()``, which reads it from disk into a new CPU tensor each call (memory:
    that tensor). What DeepSpeed's ``lazy_mode`` returns for each name; tied names share
    one ``LazyTensor``. The checkpoint stays open while any of them is alive."""

    def __init__(self, reader: "_Reader", info: Written):
        self._reader = reader
        self._info = info

    @property
    def shape(self):
        import torch

        return torch.Size(self._info.shape)

    @property
    def dtype(self):
        return output_dtype(self._info, FLOAT32).torch

    def numel(self) -> int:
        return self._info.numel

    def contiguous(self):
        return _read(self._reader.source, self._info, FLOAT32, self._reader.trainable)

    def __repr__(self) -> str:
        return f"LazyTensor({self._info.name!r}, shape={list(self._info.shape)}, dtype={self.dtype})"


class _Reader:
    """The open checkpoint behind ``LazyTensor``s: closed when the last one is gone."""

    def __init__(self, source: TensorSource):
        self.source = source
        self.trainable = _trainable(source)
        weakref.finalize(self, source.close)


def _trainable(source: TensorSource) -> set[str]:
    return {t.name for t in source.tensors() if t.kind == "param"}


def _read(source: TensorSource, info: Written, dtype, trainable: set[str]):
    """A new CPU tensor of ``info``; a trainable parameter's with ``requires_grad=True``,
    as DeepSpeed returns its fp32 masters (a ``torch.save`` of it is then byte-identical)."""
    value = read_value(source, info, dtype)
    if info.name in trainable and value.is_floating_point():
        value.requires_grad_(True)
    return value


def _entries(source: TensorSource, exclude_frozen: bool):
    """``(tensors, {alias: owner})`` in DeepSpeed's key order: the source's order
    (buffers, frozen, trainable for DeepSpeed), tied names after."""
    return written_tensors(source, exclude_frozen), written_aliases(source, exclude_frozen)


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict:
    """The checkpoint's weights as ``{name: CPU tensor}`` (floats float32; trainable
    parameters with ``requires_grad=True``), as DeepSpeed's function of this name returns
    them: a ``dict``, an ``OrderedDict`` in lazy mode. ``checkpoint_dir``: a DeepSpeed
    ZeRO-1/2/3 checkpoint folder (the one holding ``latest``), one of ours, or a tag folder.
    ``tag``: instead of ``latest``'s. ``exclude_frozen_parameters``: leave out parameters
    that had ``requires_grad=False``. ``lazy_mode``: values are ``LazyTensor``s read on
    ``.contiguous()`` (memory: the tensors the caller keeps). Memory otherwise: the whole
    model in float32."""
    source = open_weights(checkpoint_dir, tag)
    kept_open = False  # by the LazyTensors, until the last of them is gone
    try:
        tensors, aliases = _entries(source, exclude_frozen_parameters)
        if lazy_mode:
            reader = _Reader(source)
            kept_open = True
            out: dict = OrderedDict((t.name, LazyTensor(reader, t)) for t in tensors)
        else:
            trainable = _trainable(source)
            out = {t.name: _read(source, t, FLOAT32, trainable) for t in tensors}
    finally:
        if not kept_open:
            source.close()
    for alias, owner in aliases.items():
        out[alias] = out[owner]
    log.info("%s: %d tensors, %d tied names", checkpoint_dir, len(tensors), len(aliases))
    return out


def to_torch_tensor(state_dict: dict, return_empty_tensor: bool = False, dtype=None) -> dict:
    """DeepSpeed's helper of this name: a lazy state dict (``LazyTensor`` or tensor values)
    as ``{name: tensor}``, each read once (``.contiguous()``), names sharing one value
    sharing one tensor. ``dtype``: float tensors cast to it (integer and bool ones keep
    theirs); ``return_empty_tensor``: uninitialised tensors of the shapes and dtypes
    instead, nothing read."""
    import torch

    target = None if dtype is None else _output_dtype(dtype).torch
    out: dict = {}
    first: dict[int, str] = {}
    for name, value in state_dict.items():
        if id(value) in first:
            out[name] = out[first[id(value)]]
            continue
        first[id(value)] = name
        wanted = target if target is not None and value.dtype.is_floating_point else None
        if return_empty_tensor:
            out[name] = torch.empty(tuple(value.shape), dtype=wanted or value.dtype)
        else:
            tensor = value.contiguous()
            out[name] = tensor.to(wanted) if wanted is not None else tensor
    return out


def convert_zero_checkpoint_to_state_dict(checkpoint_dir: str, output_dir: str,
                                          dtype="float32", max_shard_size: int | str | None = "5GB",
                                          safe_serialization: bool = False, tag: str | None = None,
                                          exclude_frozen_parameters: bool = False) -> None:
    """Write the checkpoint's weights to ``output_dir`` as DeepSpeed's function of this
    name does: ``pytorch_model.bin`` via ``torch.save``, or ``model.safetensors`` with
    ``safe_serialization``; with ``max_shard_size`` (bytes, or "5GB" in powers of ten as
    Hugging Face counts; None: one file) shards named ``pytorch_model-00001-of-0000N.bin``
    / ``model-00001-of-0000N.safetensors`` and an index (``*.index.json``, 2-space indent,
    sorted keys). ``dtype``: float tensors' output dtype (float32, float16, bfloat16, as a
    string or torch dtype); integer and bool buffers keep theirs. Memory: one shard."""
    out_dtype = _output_dtype(dtype)
    source = open_weights(checkpoint_dir, tag)
    with source:
        tensors, aliases = _entries(source, exclude_frozen_parameters)
        infos = {t.name: t for t in tensors}
        trainable = _trainable(source)
        weights = "model.safetensors" if safe_serialization else "pytorch_model.bin"
        shards, total = _split(tensors, aliases, out_dtype,
                               None if max_shard_size is None else parse_size(max_shard_size))
        names = _shard_names(weights, len(shards))
        os.makedirs(output_dir, exist_ok=True)
        for filename, keys in zip(names, shards):
            values: dict = {}
            for key in keys:
                owner = aliases.get(key)
                values[key] = values[owner] if owner is not None else _read(
                    source, infos[key], out_dtype, trainable)
            path = os.path.join(output_dir, filename)
            try:
                _save_shard(values, aliases, path, safe_serialization)
            except OSError as e:
                raise WrappedIOError.wrap(e, f"writing {len(keys)} tensors of "
                                             f"{checkpoint_dir} to {path}", op="write") from None
            del values
            log.info("wrote %s (%d tensors)", filename, len(keys))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: f for f, keys in zip(names, shards) for k in keys}}
        with open(os.path.join(output_dir, weights + ".index.json"), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str,
                                               max_shard_size: int | str | None = "5GB",
                                               safe_serialization: bool = False,
                                               tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """``convert_zero_checkpoint_to_state_dict`` with float32 output: DeepSpeed's function
    of this name and signature (its CLI ``zero_to_fp32.py``)."""
    convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, "float32",
                                          max_shard_size, safe_serialization, tag,
                                          exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir: str, tag: str | None = None):
    """Move ``model`` to the CPU, load the checkpoint's float32 weights into it
    (non-strict: names missing on either side are left alone, as in DeepSpeed) and return
    it. Memory: the whole model in float32 (DeepSpeed's behaviour; ``offload_engine.
    consolidate.load_state_dict_from_checkpoint`` loads in place one tensor at a time)."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


def _output_dtype(dtype):
    """DeepSpeed's accepted dtype spellings ("fp16", "torch.bfloat16", torch.float32)."""
    name = str(dtype).removeprefix("torch.").lower()
    if name not in _OUTPUT_DTYPES:
        raise InputError(f"unsupported output dtype {dtype!r}; choose one of: "
                         f"{', '.join(sorted(_OUTPUT_DTYPES))}")
    return as_dtype(name)


def _split(tensors: list[Written], aliases: dict[str, str], out_dtype,
           max_bytes: int | None) -> tuple[list[list[str]], int]:
    """Shards as ``huggingface_hub.split_torch_state_dict_into_shards`` makes them from
    DeepSpeed's state dict: greedy in key order, a tensor over the limit alone, tied
    names appended to their owner's shard; and the total bytes (tied names counted once)."""
    out = [OutTensor(t.name, t.shape, output_dtype(t, out_dtype)) for t in tensors]
    total = sum(t.nbytes for t in out)
    if max_bytes is None:
        shards = [[t.name for t in out]]
    else:
        shards = [[t.name for t in group] for group in split_shards(out, max_bytes)]
    for alias, owner in aliases.items():
        next(shard for shard in shards if owner in shard).append(alias)
    return shards, total


def _shard_names(weights: str, count: int) -> list[str]:
    if count == 1:
        return [weights]
    stem, ext = weights.rsplit(".", 1)
    return [f"{stem}-{i + 1:05d}-of-{count:05d}.{ext}" for i in range(count)]


def _save_shard(values: dict, aliases: dict[str, str], path: str, safe: bool) -> None:
    import torch

    # torch.save and save_file report an unwritable path without naming it (torch: a
    # RuntimeError "open file failed"): opening it here first raises an OSError that does.
    # torch.save is still given the path: the zip's folder is named after the file, as
    # in DeepSpeed's output, which a file object would change.
    open(path, "wb").close()
    if not safe:
        torch.save(values, path)
        return
    from safetensors.torch import save_file

    metadata = {"format": "pt"}
    tied = {a: o for a, o in aliases.items() if a in values}
    metadata.update(sorted(tied.items()))
    save_file({k: v for k, v in values.items() if k not in tied}, path, metadata=metadata)
