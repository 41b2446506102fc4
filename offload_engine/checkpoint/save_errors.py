"""The error of a checkpoint save that an I/O call ended (a full disk, a failing device)."""

from __future__ import annotations

from ..io.errors import FileIOError


class CheckpointSaveError(FileIOError):
    """Saving a generation failed on an I/O error: says which generation and which rank,
    on top of the file error it wraps (``cause``: its ``errno``, ``path``, ``offset`` and
    ``length`` are this error's). Still an ``OSError``, as the I/O error was. The
    generation stays uncommitted (``<gen>.partial``, never loaded) and the previous one
    stays the loadable one."""

    def __init__(self, generation: str, rank: int, cause: OSError):
        super().__init__(cause.errno or 0, getattr(cause, "op", "I/O"),
                         getattr(cause, "path", None) or cause.filename or generation,
                         getattr(cause, "offset", None), getattr(cause, "length", None),
                         detail=cause.strerror)
        self.generation = generation
        self.rank = rank
        self.cause = cause

    def __str__(self) -> str:
        return f"saving checkpoint {self.generation} on rank {self.rank}: {self.cause}"

    def __reduce__(self):
        return type(self), (self.generation, self.rank, self.cause)


def save_error(error: BaseException, generation: str, rank: int) -> BaseException:
    """``error`` as a CheckpointSaveError when it is an I/O error (it has an errno); any
    other error as it is."""
    if isinstance(error, OSError) and error.errno and not isinstance(error, CheckpointSaveError):
        wrapped = CheckpointSaveError(generation, rank, error)
        wrapped.__cause__ = error
        return wrapped
    return error
