"""``keep_last=N``: after a commit, rank 0 removes the older generations of the checkpoint
folder, keeping the N newest and, always, the one ``latest`` names.

Newest means the highest saved step, then the latest commit (the manifest's modification
time), then the name. Only committed generations of ours count (``<gen>.partial``,
``<gen>.superseded-<k>``, other files and folders are never touched).

A removal is crash-safe in two moves: rename ``<gen>`` to ``<gen>.deleting`` (atomic: from
then on it is never loaded under any name), fsync the folder, then delete the tree. A kill
in between leaves a ``.deleting`` folder, which the next retention deletes. ``latest`` is
read again before each rename, and nothing is removed while it cannot be read; since
retention runs only once the new generation is committed and ``latest`` names it, a
loadable generation always remains.
"""

from __future__ import annotations

import logging
import os

from ..formats.errors import CheckpointError
from ..formats.latest import read_latest
from ..io import syscalls
from ..layout.generations import DELETING, PARTIAL, SUPERSEDED
from ..layout.manifest import CHECKPOINT_FORMAT
from ..layout.metadata import fsync_dir
from ..formats.ours.tensor_table import read_manifest_attrs
from ..errors import InputError

log = logging.getLogger(__name__)


def check_keep_last(keep_last) -> int | None:
    """``keep_last`` checked: None (keep everything) or an int >= 1."""
    if keep_last is None:
        return None
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise InputError(f"keep_last must be an integer >= 1 (or None to keep every "
                         f"generation), got {keep_last!r}")
    return keep_last


def committed_generations(ckpt_dir: str) -> list[tuple[int, int, str]]:
    """``[(step, commit time in ns, name)]`` of the committed generations in ``ckpt_dir``,
    oldest first. A folder whose manifest cannot be read is not counted (and never removed)."""
    out = []
    for entry in os.scandir(ckpt_dir):
        name = entry.name
        if (not entry.is_dir(follow_symlinks=False) or name.endswith(PARTIAL)
                or name.endswith(DELETING) or SUPERSEDED in name):
            continue
        try:
            attrs = read_manifest_attrs(entry.path)
            mtime = os.stat(os.path.join(entry.path, "zarr.json")).st_mtime_ns
        except (CheckpointError, OSError, ValueError):
            continue
        step = attrs.get("step")
        if attrs.get("format") != CHECKPOINT_FORMAT or attrs.get("committed") is not True \
                or type(step) is not int:
            continue
        out.append((step, mtime, name))
    return sorted(out)


def sweep_deleting(ckpt_dir: str) -> None:
    """Finish removals a crash interrupted (``<gen>.deleting`` folders)."""
    for entry in os.scandir(ckpt_dir):
        if entry.name.endswith(DELETING) and entry.is_dir(follow_symlinks=False):
            syscalls.rmtree(entry.path)


def apply_retention(ckpt_dir: str, keep_last: int, just_committed: str) -> list[str]:
    """Remove all but the ``keep_last`` newest committed generations, never the one
    ``latest`` names nor ``just_committed``; returns the names removed. Runs on rank 0
    after the commit; an error is logged, never raised (the generation is committed)."""
    removed = []
    try:
        sweep_deleting(ckpt_dir)
        gens = committed_generations(ckpt_dir)
        keep = {name for _, _, name in gens[-keep_last:]} | {just_committed}
        for _, _, name in gens:
            if name in keep:
                continue
            current = read_latest(ckpt_dir, CheckpointError)  # again before each removal
            if current == name:
                continue
            path = os.path.join(ckpt_dir, name)
            doomed = path + DELETING
            if os.path.lexists(doomed):
                syscalls.rmtree(doomed)
            syscalls.rename(path, doomed)  # from here on it is never loaded
            fsync_dir(ckpt_dir)
            syscalls.rmtree(doomed)
            removed.append(name)
    except (OSError, CheckpointError) as e:
        log.warning("%s: keep_last=%d could not remove older generations (%s); they stay, "
                    "and the next save tries again", ckpt_dir, keep_last, e)
    if removed:
        log.info("%s: keep_last=%d removed %s", ckpt_dir, keep_last, ", ".join(removed))
    return removed
