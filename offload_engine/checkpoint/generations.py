"""Writing checkpoint generations: the staging folder and the ``latest`` pointer.

The directory layout is ``layout/generations.py``; reading it back (``resolve``: which
generation ``latest`` names, torn or whole) is ``formats/ours/generations.py``. A
generation is written under ``<name>.partial``, fsynced, then renamed to ``<name>`` (the
commit point: rename is atomic, ``commit.py``), and ``latest`` is replaced last (temp
file, fsync, rename). A crash at any moment leaves the previous generation and pointer
intact.
"""

from __future__ import annotations

import os

from ..io import syscalls
from ..io.errors import FileIOError
from ..layout.generations import LATEST
from ..layout.metadata import write_text_atomic


def prepare_staging(ckpt_dir: str, final: str, staging: str, step: int) -> BaseException | None:
    """Make ``<gen>.partial`` (dropping one torn by an earlier crash); the error, if it
    cannot (rank 0 broadcasts it so that no rank waits for a save that never starts)."""
    if os.path.exists(final):
        return FileExistsError(f"{final}: a checkpoint of step {step} is already committed")
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


def write_latest(ckpt_dir: str, name: str) -> None:
    """Point ``latest`` at generation ``name`` atomically (temp, fsync, rename, fsync dir).

    The temporary file gets a new random name and is created exclusively, never through a
    symlink (``write_text_atomic``): a fixed name such as ``.latest.tmp`` could be a link
    planted there, and writing through it would overwrite (as root: any) file."""
    write_text_atomic(os.path.join(ckpt_dir, LATEST), name + "\n")
