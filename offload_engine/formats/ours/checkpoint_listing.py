"""Reading one of our checkpoint directories: which generation ``latest`` (or a tag) names
and whether it loads, and which committed generations the directory holds. The names are
``layout/checkpoint_names.py``; writing the directory is ``checkpoint/checkpoint_dir.py``.

A generation is committed when its directory exists under its final name (the rename is
atomic) and its manifest says ``committed``; ``<name>.partial`` (torn) and
``<name>.deleting`` (being removed) are never read, and ``<name>.superseded-<k>`` only when
asked for by that name.

A run saving with ``keep_last`` removes old generations while others may be reading them.
A reader whose generation disappears under it (renamed to ``.deleting``, then deleted)
reports that (``GenerationRemovedError``), not a corrupt checkpoint: ``was_removed``
tells the two apart, by whether the generation's folder still exists under its name.
"""

from __future__ import annotations

import os

from ...layout.checkpoint_names import (LATEST, PARTIAL, deleting_path, is_being_deleted,
                                        is_set_aside, is_torn, read_latest)
from ...layout.manifest import CHECKPOINT_FORMAT
from ...layout.metadata import ZARR_JSON
from ..errors import CheckpointError
from .tensor_table import gc_paused, parse_manifest, read_manifest_attrs


class GenerationRemovedError(CheckpointError):
    """The generation being read was removed meanwhile (by the ``keep_last`` retention of
    the run writing the folder, or by hand): not corruption; read ``latest`` again."""


def was_removed(gen: str, error: BaseException) -> GenerationRemovedError | None:
    """The error to raise instead of ``error`` (met while reading generation ``gen``) when
    ``gen`` no longer exists under its name; None when it does (then ``error`` stands: a
    file missing from a generation still there is damage, not retention, or ``error``
    already says so: a reader nested in another)."""
    if isinstance(error, GenerationRemovedError) or os.path.isdir(gen):
        return None
    name = os.path.basename(os.path.normpath(gen))
    how = ("keep_last retention of the run saving into the folder is removing it"
           if os.path.lexists(deleting_path(gen)) else "it no longer exists")
    return GenerationRemovedError(
        f"{gen}: generation {name} was removed while being read ({how}), not damaged: "
        f"what was read is incomplete; load again, or run the command again, to read the "
        f"generation 'latest' names now ({error})")


def find_generation(ckpt_dir: str, tag: str | None = None) -> str:
    """The directory of generation ``tag`` of ``ckpt_dir`` (default: the one ``latest``
    names; ``ckpt_dir`` itself when it is a generation and no tag is given), checked to
    exist and not be torn; its manifest is left to whoever reads it. Errors
    (CheckpointError) name the file and what is wrong."""
    if tag is None and os.path.isfile(os.path.join(ckpt_dir, ZARR_JSON)):
        if is_torn(os.path.basename(os.path.normpath(ckpt_dir))):
            raise CheckpointError(f"{ckpt_dir}: a torn (uncommitted) generation")
        if is_being_deleted(os.path.basename(os.path.normpath(ckpt_dir))):
            raise CheckpointError(f"{ckpt_dir}: a generation being removed by keep_last")
        return ckpt_dir
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir}: no such checkpoint directory")
    from_latest = tag is None  # a wrong name in latest (edited, or damaged) names latest too
    if from_latest:
        tag = read_latest(ckpt_dir, CheckpointError)
        for _ in range(3):  # a save moved latest on and retention removed what it named
            if os.path.isdir(os.path.join(ckpt_dir, tag)):
                break
            again = read_latest(ckpt_dir, CheckpointError)
            if again == tag:
                break
            tag = again
    gen = os.path.join(ckpt_dir, tag)

    def where(what: str) -> str:
        if from_latest:
            return f"{os.path.join(ckpt_dir, LATEST)} names {tag!r}, but {gen} {what}"
        return f"{gen}: {what}"
    if is_torn(tag):
        raise CheckpointError(where("is a torn (uncommitted) generation"))
    if is_being_deleted(tag):
        raise CheckpointError(where("is a generation being removed by keep_last"))
    if not os.path.isdir(gen):
        torn = os.path.isdir(gen + PARTIAL)
        raise CheckpointError(where("does not exist"
                                    + (" (only a torn .partial copy exists)" if torn else "")))
    return gen


def resolve(ckpt_dir: str, tag: str | None = None) -> str:
    """``find_generation``, and the generation's manifest checked as every reader checks it
    (format, version, committed, its tables): the directory of a generation that loads."""
    gen = find_generation(ckpt_dir, tag)
    with gc_paused():
        parse_manifest(read_manifest_attrs(gen), "checkpoint", os.path.join(gen, ZARR_JSON))
    return gen


def list_committed_generations(ckpt_dir: str) -> list[tuple[int, int, str]]:
    """``[(step, commit time in ns, name)]`` of the committed generations in ``ckpt_dir``,
    oldest first (the highest step is newest, then the latest commit: the manifest's
    modification time, then the name). Only folders under a generation's final name whose
    manifest is ours and says committed count; a folder whose manifest cannot be read is
    left out."""
    out = []
    for entry in os.scandir(ckpt_dir):
        name = entry.name
        if (not entry.is_dir(follow_symlinks=False) or is_torn(name)
                or is_being_deleted(name) or is_set_aside(name)):
            continue
        try:
            attrs = read_manifest_attrs(entry.path)
            mtime = os.stat(os.path.join(entry.path, ZARR_JSON)).st_mtime_ns
        except (CheckpointError, OSError, ValueError):
            continue
        step = attrs.get("step")
        if attrs.get("format") != CHECKPOINT_FORMAT or attrs.get("committed") is not True \
                or type(step) is not int:
            continue
        out.append((step, mtime, name))
    return sorted(out)
