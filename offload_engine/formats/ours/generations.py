"""Finding a committed generation in one of our checkpoint directories (layout/generations.py
names the files), and telling torn from whole: the read side of a checkpoint directory.

A generation is committed when its directory exists under its final name (the rename is
atomic) and its manifest says ``committed``; ``<name>.partial`` is never read.
"""

from __future__ import annotations

import os

from ...layout.generations import PARTIAL
from ..errors import CheckpointError
from ..latest import read_latest


def resolve(ckpt_dir: str, tag: str | None = None) -> str:
    """The directory of generation ``tag`` (default: the one ``latest`` names), checked to
    exist and not be torn. Its manifest is checked by whoever reads it (``OursSource``).
    Errors (CheckpointError) name the file and what is wrong."""
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir}: no such checkpoint directory")
    if tag is None:
        tag = read_latest(ckpt_dir, CheckpointError)
    if tag.endswith(PARTIAL):
        raise CheckpointError(f"{os.path.join(ckpt_dir, tag)}: a torn (uncommitted) generation")
    gen = os.path.join(ckpt_dir, tag)
    if not os.path.isdir(gen):
        torn = os.path.isdir(gen + PARTIAL)
        raise CheckpointError(f"{gen}: does not exist"
                              + (" (only a torn .partial copy exists)" if torn else ""))
    return gen
