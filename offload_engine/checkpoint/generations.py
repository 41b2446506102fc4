"""Writing checkpoint generations: the staging folder and the ``latest`` pointer.

The directory layout is ``layout/generations.py``; reading it back (``resolve``: which
generation ``latest`` names, torn or whole) is ``formats/ours/generations.py``. A
generation is written under ``<name>.partial``, fsynced, then renamed to ``<name>`` (the
commit point: rename is atomic, ``commit.py``), and ``latest`` is replaced last (temp
file, fsync, rename). A crash at any moment leaves the previous generation and pointer
intact.
"""

from __future__ import annotations

import logging
import os

from ..formats.errors import CheckpointError
from ..formats.latest import read_latest
from ..io import syscalls
from ..io.errors import FileIOError
from ..layout.generations import LATEST, SUPERSEDED
from ..layout.metadata import fsync_dir, write_text_atomic
from ..errors import PathExistsError

log = logging.getLogger(__name__)


def prepare_staging(ckpt_dir: str, final: str, staging: str, step: int) -> BaseException | None:
    """Make ``<gen>.partial`` (dropping one torn by an earlier crash, and setting aside a
    generation of the same name that ``latest`` does not name: ``set_aside_orphan``); the
    error, if it cannot (rank 0 broadcasts it so that no rank waits for a save that never
    starts)."""
    if os.path.exists(final):
        problem = set_aside_orphan(ckpt_dir, final, step)
        if problem is not None:
            return problem
    where = ("mkdir", ckpt_dir)
    try:
        syscalls.makedirs(ckpt_dir, exist_ok=True)
        if os.path.lexists(staging):
            where = ("remove", staging)
            syscalls.rmtree(staging)  # torn by an earlier crash: never loadable, safe to drop
        where = ("mkdir", staging)
        syscalls.makedirs(staging)
    except OSError as e:
        return FileIOError(e.errno, *where, detail=e.strerror)
    return None


def set_aside_orphan(ckpt_dir: str, final: str, step: int) -> BaseException | None:
    """``final`` exists. When ``latest`` names it, saving that step again is an error
    (returned). Otherwise it is an orphan: committed by a run that crashed between the
    rename and the update of ``latest``, or left by a timeline that ``latest`` was rolled
    back from. Resuming from ``latest`` saves this step again, so the orphan is renamed
    to ``<name>.superseded-<k>`` (kept, never loaded: no reader follows that name unless
    asked for it) with a warning naming it, and None is returned. An unreadable
    ``latest`` is an error: what it should name is unknown, so nothing is moved."""
    name = os.path.basename(final)
    try:
        current = read_latest(ckpt_dir, CheckpointError)
    except CheckpointError as e:
        if not os.path.lexists(os.path.join(ckpt_dir, LATEST)):
            current = None  # the first save crashed before writing latest
        else:
            return PathExistsError(f"{final}: a checkpoint of step {step} is already "
                                   f"committed, and latest cannot be read to tell whether "
                                   f"it is the current one ({e})")
    if current == name:
        return PathExistsError(f"{final}: a checkpoint of step {step} is already committed "
                               f"(and latest names it)")
    k = 1
    while os.path.lexists(f"{final}{SUPERSEDED}{k}"):
        k += 1
    aside = f"{final}{SUPERSEDED}{k}"
    try:
        syscalls.rename(final, aside)
    except OSError as e:
        return FileIOError(e.errno, "rename", final, detail=e.strerror)
    fsync_dir(ckpt_dir)
    log.warning("%s was committed but latest names %s (a crash between the commit and the "
                "update of latest, or a rollback): kept as %s, which is never loaded; "
                "saving step %d again", final, repr(current) if current else "nothing",
                aside, step)
    return None


def write_latest(ckpt_dir: str, name: str) -> None:
    """Point ``latest`` at generation ``name`` atomically (temp, fsync, rename, fsync dir).

    The temporary file gets a new random name and is created exclusively, never through a
    symlink (``write_text_atomic``): a fixed name such as ``.latest.tmp`` could be a link
    planted there, and writing through it would overwrite (as root: any) file."""
    write_text_atomic(os.path.join(ckpt_dir, LATEST), name + "\n")
