"""Whether a directory's file system takes O_DIRECT, asked before choosing how to write there."""

from __future__ import annotations

import errno
import mmap
import os
import uuid

from . import syscalls
from .align import ALIGN

PROBE_NAME = ".direct-probe"


def probe_direct(directory: str | os.PathLike, *, strict: bool = True) -> bool:
    """Whether files in ``directory`` take O_DIRECT: a probe file is opened with it and
    4 KiB written (some file systems accept the open but refuse the I/O; tmpfs and some
    network file systems refuse the open), then removed.

    A refusal (EINVAL) is False. Any other error (no such directory, no permission, a
    full disk) is raised with ``strict`` (a benchmark reports it); without, it is False
    too, for a caller that then writes buffered and meets any real error there.
    """
    if not hasattr(os, "O_DIRECT"):
        return False
    # a new name, created exclusively and never through a symlink: a file or link already
    # there (planted, or left by a crash) is never written to or removed
    probe = os.path.join(os.fspath(directory), f"{PROBE_NAME}.{uuid.uuid4().hex}")
    buf = mmap.mmap(-1, ALIGN)  # page-aligned, as O_DIRECT wants
    try:
        fd = syscalls.open_fd(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | syscalls.NOFOLLOW
                              | os.O_DIRECT | syscalls.CLOEXEC, 0o600)
        try:
            syscalls.pwritev(fd, [buf], 0, probe)
            return True
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno == errno.EINVAL or not strict:
            return False
        raise
    finally:
        buf.close()
        try:  # ours whatever happened (a refused O_DIRECT open may still create it)
            syscalls.unlink(probe)
        except FileNotFoundError:
            pass
        except OSError:
            if strict:
                raise
