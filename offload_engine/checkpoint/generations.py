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
import shutil

from ..layout.generations import LATEST
from ..layout.metadata import fsync_dir


def prepare_staging(ckpt_dir: str, final: str, staging: str, step: int) -> BaseException | None:
    """Make ``<gen>.partial`` (dropping one torn by an earlier crash); the error, if it
    cannot (rank 0 broadcasts it so that no rank waits for a save that never starts)."""
    try:
        if os.path.exists(final):
            return FileExistsError(f"{final}: a checkpoint of step {step} is already committed")
        os.makedirs(ckpt_dir, exist_ok=True)
        if os.path.exists(staging):
            shutil.rmtree(staging)  # torn by an earlier crash: never loadable, safe to drop
        os.makedirs(staging)
    except OSError as e:
        return e
    return None


def write_latest(ckpt_dir: str, name: str) -> None:
    """Point ``latest`` at generation ``name`` atomically (temp, fsync, rename, fsync dir)."""
    tmp = os.path.join(ckpt_dir, f".{LATEST}.tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(ckpt_dir, LATEST))
    fsync_dir(ckpt_dir)
