"""Finding a committed generation in one of our checkpoint directories (layout/generations.py
names the files), and telling torn from whole: the read side of a checkpoint directory.

A generation is committed when its directory exists under its final name (the rename is
atomic) and its manifest says ``committed``; ``<name>.partial`` is never read.
"""

from __future__ import annotations

import os

from ...layout.generations import DELETING, PARTIAL
from ..errors import CheckpointError
from ..latest import read_latest
from .tensor_table import gc_paused, parse_manifest, read_manifest_attrs


def locate(ckpt_dir: str, tag: str | None = None) -> str:
    """The directory of generation ``tag`` of ``ckpt_dir`` (default: the one ``latest``
    names; ``ckpt_dir`` itself when it is a generation and no tag is given), checked to
    exist and not be torn; its manifest is left to whoever reads it. Errors
    (CheckpointError) name the file and what is wrong."""
    if tag is None and os.path.isfile(os.path.join(ckpt_dir, "zarr.json")):
        if os.path.basename(os.path.normpath(ckpt_dir)).endswith(PARTIAL):
            raise CheckpointError(f"{ckpt_dir}: a torn (uncommitted) generation")
        if os.path.basename(os.path.normpath(ckpt_dir)).endswith(DELETING):
            raise CheckpointError(f"{ckpt_dir}: a generation being removed by keep_last")
        return ckpt_dir
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir}: no such checkpoint directory")
    from_latest = tag is None  # a wrong name in latest (edited, or damaged) names latest too
    if from_latest:
        tag = read_latest(ckpt_dir, CheckpointError)
    gen = os.path.join(ckpt_dir, tag)

    def where(what: str) -> str:
        if from_latest:
            return f"{os.path.join(ckpt_dir, 'latest')} names {tag!r}, but {gen} {what}"
        return f"{gen}: {what}"
    if tag.endswith(PARTIAL):
        raise CheckpointError(where("is a torn (uncommitted) generation"))
    if tag.endswith(DELETING):
        raise CheckpointError(where("is a generation being removed by keep_last"))
    if not os.path.isdir(gen):
        torn = os.path.isdir(gen + PARTIAL)
        raise CheckpointError(where("does not exist"
                                    + (" (only a torn .partial copy exists)" if torn else "")))
    return gen


def resolve(ckpt_dir: str, tag: str | None = None) -> str:
    """``locate``, and the generation's manifest checked as every reader checks it (format,
    version, committed, its tables): the directory of a generation that loads."""
    gen = locate(ckpt_dir, tag)
    with gc_paused():
        parse_manifest(read_manifest_attrs(gen), "checkpoint", os.path.join(gen, "zarr.json"))
    return gen
