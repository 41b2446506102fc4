"""Errors of reading checkpoints and weight files, and the checkpoint error family.

``FormatError`` and ``CheckpointError`` are ``InputError``s (so ``ValueError``s) whose
message names the file (or directory) and says what is wrong; the command line prints them
as one line and exits 2. ``CheckpointSaveError`` is the checkpoint family's I/O member: a
``CheckpointError`` that is also the ``OSError`` it wraps; ``CheckpointExistsError`` (a
step or tag that is already committed) is also a ``PathExistsError``. They live here, below
checkpoint/, because the readers in this layer raise them too.

A chunk file that does not match its recorded crc32c is ``layout.checksums.ChecksumError``,
whoever reads it; an I/O failure is ``io.FileIOError`` (errno, path, offset, length).
"""

from __future__ import annotations

from ..errors import InputError, PathExistsError
from ..io.errors import WrappedIOError


class FormatError(InputError):
    """Input that cannot be read as what it is: unknown kind, malformed manifest or
    header, a missing rank, an impossible shape."""


class CheckpointError(FormatError):
    """One of our checkpoints that cannot be loaded or saved: missing, torn, corrupt, (when
    loading into a model) one of another model, or (``CheckpointSaveError``) a save that an
    I/O error ended."""


class CheckpointSaveError(WrappedIOError, CheckpointError):
    """Saving a generation failed on an I/O error: says which generation and which rank,
    on top of the file error it wraps (``cause``: its ``errno``, ``path``, ``offset`` and
    ``length`` are this error's). Still an ``OSError``, as the I/O error was. The
    generation stays uncommitted (``<gen>.partial``, never loaded) and the previous one
    stays the loadable one."""

    def __init__(self, generation: str, rank: int, cause: OSError):
        super().__init__(f"saving checkpoint {generation} on rank {rank}", cause)
        self.generation = generation
        self.rank = rank


class CheckpointExistsError(CheckpointError, PathExistsError):
    """Saving a generation whose name is already committed and named by ``latest`` (or
    whether it is cannot be told): refused, nothing is replaced. Both a ``ValueError`` and
    a ``FileExistsError``, as each family's callers catch it."""
