"""``keep_last=N``: after a commit, rank 0 removes the older generations of the checkpoint
folder, keeping the N newest and, always, the one ``latest`` names.

Newest means the highest saved step, then the latest commit (the manifest's modification
time), then the name. Only committed generations of ours count
(``formats/ours/checkpoint_listing.py``: ``<gen>.superseded-<k>``, other files and
folders are never touched; ``<gen>.partial``: below).

A removal is crash-safe in two moves: rename ``<gen>`` to ``<gen>.deleting`` (atomic: from
then on it is never loaded under any name), fsync the folder, then delete the tree. A kill
in between leaves a ``.deleting`` folder, which the next retention deletes. ``latest`` is
read again before each rename, and nothing is removed while it cannot be read; since
retention runs only once the new generation is committed and ``latest`` names it, a
loadable generation always remains.

Retention also removes ``<gen>.partial`` folders left by a crashed writer, but only while
this run holds the folder's writer lock (writer_lock.py): the lock proves that no other
run is writing one, and this process's own saves in flight are skipped by name. Without
the lock (a file system that cannot lock) they stay: one may be a live writer's.
"""

from __future__ import annotations

import logging
import os

from ..errors import InputError
from ..formats.errors import CheckpointError
from ..formats.ours.checkpoint_listing import list_committed_generations
from ..io import syscalls
from ..layout.checkpoint_names import deleting_path, is_being_deleted, is_torn, read_latest
from ..layout.metadata import fsync_dir
from .writer_lock import WriterLock, in_flight

log = logging.getLogger(__name__)


def check_keep_last(keep_last) -> int | None:
    """``keep_last`` checked: None (keep everything) or an int >= 1."""
    if keep_last is None:
        return None
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise InputError(f"keep_last must be an integer >= 1 (or None to keep every "
                         f"generation), got {keep_last!r}")
    return keep_last


def sweep_deleting(ckpt_dir: str) -> None:
    """Finish removals a crash interrupted (``<gen>.deleting`` folders)."""
    for entry in os.scandir(ckpt_dir):
        if is_being_deleted(entry.name) and entry.is_dir(follow_symlinks=False):
            syscalls.rmtree(entry.path)


def sweep_stale_staging(ckpt_dir: str, lock: WriterLock) -> list[str]:
    """Remove the ``<gen>.partial`` folders of ``ckpt_dir`` that no save is writing: those
    of crashed writers. Only while ``lock`` is held (no other run writes here); this
    process's saves in flight are kept. Returns the names removed."""
    if lock is None or not lock.held:
        return []
    keep = {os.path.basename(p) for p in in_flight(lock)}
    removed = []
    for entry in os.scandir(ckpt_dir):
        if is_torn(entry.name) and entry.name not in keep and entry.is_dir(follow_symlinks=False):
            syscalls.rmtree(entry.path)  # never loaded: nothing a reader could be reading
            removed.append(entry.name)
    return removed


def apply_retention(ckpt_dir: str, keep_last: int, just_committed: str,
                    lock: WriterLock | None = None) -> list[str]:
    """Remove all but the ``keep_last`` newest committed generations, never the one
    ``latest`` names nor ``just_committed``, and (holding ``lock``) the staging folders of
    crashed writers; returns the names removed. Runs on rank 0 after the commit; an error
    is logged, never raised (the generation is committed)."""
    removed = []
    try:
        sweep_deleting(ckpt_dir)
        removed += sweep_stale_staging(ckpt_dir, lock)
        gens = list_committed_generations(ckpt_dir)
        keep = {name for _, _, name in gens[-keep_last:]} | {just_committed}
        for _, _, name in gens:
            if name in keep:
                continue
            current = read_latest(ckpt_dir, CheckpointError)  # again before each removal
            if current == name:
                continue
            path = os.path.join(ckpt_dir, name)
            doomed = deleting_path(path)
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
