"""What kind of input a path is, from names and metadata only: the one detector every
command uses (consolidate, inspect, diff, export).

=====================================  ===============================================
path                                   kind
=====================================  ===============================================
dir with zarr.json, format ...-store   ``store`` (a live TieredStore directory)
dir of ``rank{r}`` stores              a store root: ``store_root_ranks`` lists them
                                         (``inspect`` lists each; others take one)
dir with zarr.json, format ...-ckpt    ``checkpoint`` (one generation)
dir with ``latest`` naming a group     ``checkpoint`` (the generation ``latest`` names)
dir with ``latest`` naming a folder    ``deepspeed`` (the tag folder ``latest`` names)
  of ``*_optim_states.pt``
dir of ``*_optim_states.pt``           ``deepspeed`` (that tag folder)
``*.safetensors``, ``*.index.json``,   ``safetensors``
  dir of them
=====================================  ===============================================
"""

from __future__ import annotations

import os
import re

from ..layout.checkpoint_names import LATEST, is_generation_name, is_torn, read_latest
from .deepspeed.files import is_optim_file
from .errors import CheckpointError, FormatError
from .ours.tensor_table import FORMATS, gc_paused, read_manifest_attrs


def _is_ds_tag(d: str) -> bool:
    try:
        return any(is_optim_file(f) for f in os.listdir(d))
    except OSError:
        return False


def _says_checkpoint(d: str) -> bool:
    """Whether ``d`` looks like a generation of ours: named like one and holding a
    zarr.json, or naming our format in the first bytes of its zarr.json (the manifest names
    its format first). A hint for an error message, so neither a large manifest nor a
    broken one is parsed for it."""
    manifest = os.path.join(d, "zarr.json")
    if is_generation_name(os.path.basename(d)) and os.path.isfile(manifest):
        return True
    try:
        with open(manifest, "rb") as f:
            return f'"format":"{FORMATS["checkpoint"]}"'.encode() in f.read(4096)
    except OSError:
        return False


_RANK_DIR = re.compile(r"rank(\d+)")


def store_root_ranks(path: str) -> list[tuple[int, str]]:
    """``[(rank, folder)]`` when ``path`` is the root of a ZeroMuon store (the directory
    given as ``nvme_paths``: no zarr.json of its own, one store folder ``rank{r}`` per
    rank), in rank order; else ``[]``. A folder whose manifest cannot be read is left
    out (opening it says what is wrong)."""
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "zarr.json")):
        return []
    found = []
    for name in os.listdir(path):
        m = _RANK_DIR.fullmatch(name)
        if m is None:
            continue
        folder = os.path.join(path, name)
        try:
            if _group_format(folder) == FORMATS["store"]:
                found.append((int(m.group(1)), folder))
        except (CheckpointError, OSError):
            continue
    return sorted(found)


def _not_torn(name: str, where: str) -> None:
    if is_torn(name):
        raise FormatError(f"{where}: {name!r} is a torn (uncommitted) generation")


def _group_attrs(d: str) -> dict | None:
    """The attributes of the group at ``d``, None when ``d`` holds no zarr.json. A
    zarr.json that cannot be read is our input (the only zarr groups we read are our stores
    and generations) with a broken manifest: said so, with what is wrong, rather than
    trying the other formats and reporting that ``d`` is none of them."""
    if not os.path.isfile(os.path.join(d, "zarr.json")):
        return None
    try:
        return read_manifest_attrs(d)
    except CheckpointError as e:
        raise CheckpointError(f"{d}: an offload-engine checkpoint generation or store whose "
                              f"manifest cannot be read: {e}") from None


def _group_format(d: str, seen: dict | None = None) -> str | None:
    """The manifest format of the group at ``d`` (None: not a group); ``seen`` keeps the
    parsed attributes, so the manifest is read once even when it is large."""
    attrs = _group_attrs(d)
    if attrs is None:
        return None
    if seen is not None:
        seen[os.path.abspath(d)] = attrs
    fmt = attrs.get("format")
    return fmt if isinstance(fmt, str) else ""


def detect(path: str, generation: str | None = None) -> tuple[str, str, str | None]:
    """``(kind, path to open, generation or tag)``; FormatError when it is none of them."""
    return detect_with_manifest(path, generation)[:3]


def detect_with_manifest(path: str, generation: str | None = None, seen: dict | None = None):
    """``detect`` plus the group attributes it parsed for a store or checkpoint (else None)."""
    seen = {} if seen is None else seen
    with gc_paused():  # a large manifest is parsed here
        kind, target, gen = _detect(path, generation, seen)
    return kind, target, gen, seen.get(os.path.abspath(target))


def _named(root: str, name: str, seen: dict, why: str) -> tuple[str, str, str]:
    """The generation or DeepSpeed tag folder ``root/name`` (it exists), ``why`` saying
    who named it in errors."""
    target = os.path.join(root, name)
    fmt = _group_format(target, seen)
    if fmt == FORMATS["checkpoint"]:
        return "checkpoint", target, name
    if _is_ds_tag(target):
        return "deepspeed", root, name
    if fmt is not None:
        raise FormatError(f"{os.path.join(target, 'zarr.json')} ({why}): the manifest's format "
                          f"is {fmt!r}, not {FORMATS['checkpoint']!r}")
    raise FormatError(f"{target} ({why}) is neither a checkpoint generation nor a DeepSpeed "
                      f"tag folder")


def _detect(path: str, generation: str | None, seen: dict) -> tuple[str, str, str | None]:
    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise FormatError(f"{path}: no such file or directory")
    if os.path.isfile(path):
        if path.endswith(".safetensors") or path.endswith(".index.json"):
            return "safetensors", path, None
        if path.endswith(".pt"):
            raise FormatError(f"{path}: a single .pt file; pass the DeepSpeed checkpoint folder "
                               f"(holding 'latest') or its tag folder")
        raise FormatError(f"{path}: not a safetensors file (*.safetensors) or index "
                           f"(*.index.json)")
    if generation is not None:
        _not_torn(generation, path)
        target = os.path.join(path, generation)
        if not os.path.isdir(target):
            raise FormatError(f"{target}: generation or tag folder {generation!r} not found")
        return _named(path, generation, seen, "the generation or tag asked for")
    fmt = _group_format(path, seen)
    if fmt == FORMATS["checkpoint"]:
        _not_torn(os.path.basename(path), path)
    if fmt == FORMATS["store"]:
        return "store", path, None
    if fmt == FORMATS["checkpoint"]:
        return "checkpoint", path, os.path.basename(path)
    if fmt is not None:
        raise FormatError(f"{os.path.join(path, 'zarr.json')}: a zarr group whose attributes "
                           f"are not an offload-engine manifest (format {fmt!r})")
    if os.path.isfile(os.path.join(path, LATEST)):
        name = read_latest(path, FormatError)
        _not_torn(name, os.path.join(path, LATEST))
        target = os.path.join(path, name)
        if not os.path.isdir(target):
            raise FormatError(f"{os.path.join(path, 'latest')} names {name!r}, but {target} "
                               f"does not exist")
        return _named(path, name, seen, "named by 'latest'")
    if _is_ds_tag(path):
        return "deepspeed", os.path.dirname(path), os.path.basename(path)
    # generations or tag folders without 'latest': say which, before any safetensors beside
    # them (DeepSpeed's folder may hold a consolidated copy) is taken for the input
    tags = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d))
                  and not is_torn(d)
                  and (_is_ds_tag(os.path.join(path, d)) or _says_checkpoint(os.path.join(path, d))))
    if tags:
        raise FormatError(f"{os.path.join(path, 'latest')}: no 'latest' file; pass --tag "
                          f"(generations or tag folders here: {', '.join(tags)})")
    if any(f.endswith(".safetensors") or f == "model.safetensors.index.json"
           for f in os.listdir(path)):
        return "safetensors", path, None
    ranks = store_root_ranks(path)
    if ranks:
        shown = ", ".join(os.path.basename(d) for _, d in ranks[:4]) + (
            ", ..." if len(ranks) > 4 else "")
        raise FormatError(f"{path}: the root of a store (one folder per rank: {shown}); pass "
                          f"one rank's folder, e.g. {ranks[0][1]} (`inspect` lists them all)")
    raise FormatError(f"{path}: not a store, a checkpoint, a DeepSpeed checkpoint or "
                       f"safetensors (no zarr.json, 'latest', *_optim_states.pt or *.safetensors)")
