"""The file system calls of the store and of checkpoint saving, in one place.

Each function is the ``os`` call it is named after, preceded by ``faults.point`` (test-only
fault injection, io/faults.py; one global read when disarmed). The modules of io/,
layout/, store/ and checkpoint/ that write (or read what they wrote) call these instead
of ``os``, so a test can make any one of their calls fail the way a full disk or a failing
device would (tests/io/test_fault_injection.py checks that no direct call is left).
Calls on a descriptor take the file's path too, for the fault plan to match it by.

Errors are the ``OSError`` of the call; the callers turn them into errors that say what
they were doing (``FileIOError``: operation, file, offset, errno).

Recording (test-only, ``record_calls``): the calls that change what is on disk (create,
write, allocate, truncate, sync, rename, mkdir, remove, link) can be handed to a recorder,
which makes the call itself and notes it: the power-loss test
(tests/checkpoint/test_durability.py) replays real saves under the pessimistic model of
what survives a power cut. Off (always, outside tests) it costs one global read per call.
Reads are never recorded.
"""

from __future__ import annotations

import errno
import os
import shutil

from .faults import point

# O_NOFOLLOW where the platform has it: files we create under fixed names must not be
# symlinks planted by someone else (we would write through them)
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)

# None, or the test's recorder: ``call(op, fn, args, path, fd=None, dst=None, data=None)``
# runs ``fn(*args)`` and returns its result, noting the call (op: "create", "write",
# "allocate", "truncate", "fsync", "fdatasync", "write_out", "rename", "mkdir", "unlink",
# "rmtree", "symlink"); process-wide, seen by every thread
_recorder = None


def record_calls(recorder) -> None:
    """Hand every call that changes the disk to ``recorder`` (None: stop). Tests only."""
    global _recorder
    _recorder = recorder


def open_fd(path: str, flags: int, mode: int = 0o644) -> int:
    """``os.open``; a call that may create the file counts as an "open" that can fail."""
    point("open", path)
    if _recorder is not None and flags & os.O_CREAT:
        return _recorder.call("create", os.open, (path, flags, mode), path)
    return os.open(path, flags, mode)


def pwritev(fd: int, buffers, offset: int, path: str) -> int:
    point("write", path)
    if _recorder is not None:
        return _recorder.call("write", os.pwritev, (fd, buffers, offset), path, fd=fd)
    return os.pwritev(fd, buffers, offset)


def preadv(fd: int, buffers, offset: int, path: str) -> int:
    point("read", path)
    return os.preadv(fd, buffers, offset)


def pwrite(fd: int, data: bytes, offset: int, path: str) -> int:
    point("write", path)
    if _recorder is not None:
        return _recorder.call("write", os.pwrite, (fd, data, offset), path, fd=fd)
    return os.pwrite(fd, data, offset)


def write_all(fd: int, data: bytes, path: str) -> None:
    """Write every byte of ``data`` at the descriptor's position (short writes continue)."""
    view = memoryview(data)
    while view:
        point("write", path)
        if _recorder is not None:  # the bytes too: small files (latest) are read back
            n = _recorder.call("write", os.write, (fd, view), path, fd=fd, data=bytes(view))
        else:
            n = os.write(fd, view)
        view = view[n:]


def read_all(path: str, limit: int | None = None, flags: int = 0) -> bytes:
    """The bytes of file ``path`` (at most ``limit`` + 1 when given, so the caller can tell
    a file over its limit); ``flags`` are added to the open's (``NOFOLLOW``). Opened with
    the builtin ``open`` (an opener adds the flags), which is what tests that watch the
    files a command reads spy on."""
    point("open", path)
    with open(path, "rb", opener=lambda p, f: os.open(p, f | CLOEXEC | flags)) as f:
        point("read", path)
        return f.read() if limit is None else f.read(limit + 1)


def fsync(fd: int, path: str) -> None:
    point("sync", path)
    if _recorder is not None:
        return _recorder.call("fsync", os.fsync, (fd,), path, fd=fd)
    os.fsync(fd)


def fdatasync(fd: int, path: str) -> None:
    point("sync", path)
    if _recorder is not None:
        return _recorder.call("fdatasync", os.fdatasync, (fd,), path, fd=fd)
    os.fdatasync(fd)


def fallocate(fd: int, offset: int, length: int, path: str) -> None:
    """``os.posix_fallocate``: reserve ``length`` bytes from ``offset``."""
    point("allocate", path)
    if _recorder is not None:
        return _recorder.call("allocate", os.posix_fallocate, (fd, offset, length), path, fd=fd)
    os.posix_fallocate(fd, offset, length)


def ftruncate(fd: int, length: int, path: str) -> None:
    point("truncate", path)
    if _recorder is not None:
        return _recorder.call("truncate", os.ftruncate, (fd, length), path, fd=fd)
    os.ftruncate(fd, length)


def replace(src: str, dst: str) -> None:
    point("rename", dst)
    if _recorder is not None:
        return _recorder.call("rename", os.replace, (src, dst), src, dst=dst)
    os.replace(src, dst)


def rename(src: str, dst: str) -> None:
    point("rename", dst)
    if _recorder is not None:
        return _recorder.call("rename", os.rename, (src, dst), src, dst=dst)
    os.rename(src, dst)


def makedirs(path: str, exist_ok: bool = False, durable: bool = False) -> None:
    """``os.makedirs``; a directory already there (with ``exist_ok``) makes no call.

    ``durable``: then fsync the parent of each directory it created, outermost first. A
    new directory's name is durable only once its parent directory is fsynced: without it,
    a power cut can lose the directory and everything later made durable inside it (the
    checkpoint folder made by a run's first save, issue 30, item 8)."""
    if exist_ok and os.path.isdir(path):
        return
    created = _missing_dirs(path) if durable else []
    point("mkdir", path)
    if _recorder is not None:
        _recorder.call("mkdir", os.makedirs, (path, 0o777, exist_ok), path)
    else:
        os.makedirs(path, exist_ok=exist_ok)
    for directory in created:
        fsync_dir(os.path.dirname(directory))


def _missing_dirs(path: str) -> list[str]:
    """The directories of ``path`` that do not exist, outermost first."""
    path = os.path.abspath(path)
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing[::-1]


def fsync_dir(path: str) -> None:
    """fsync directory ``path``: the entries created, renamed or removed in it become
    durable (open, fsync, close)."""
    fd = open_fd(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | CLOEXEC)
    try:
        fsync(fd, path)
    finally:
        os.close(fd)


def unlink(path: str) -> None:
    point("remove", path)
    if _recorder is not None:
        return _recorder.call("unlink", os.unlink, (path,), path)
    os.unlink(path)


def rmtree(path: str) -> None:
    point("remove", path)
    if _recorder is not None:
        return _recorder.call("rmtree", shutil.rmtree, (path,), path)
    shutil.rmtree(path)


def symlink(target: str, link: str) -> None:
    point("link", link)
    if _recorder is not None:
        return _recorder.call("symlink", os.symlink, (target, link), link)
    os.symlink(target, link)


def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
    """``os.posix_fadvise``, a hint: a refusal (a file system without it) is ignored."""
    try:
        os.posix_fadvise(fd, offset, length, advice)
    except (OSError, AttributeError):
        pass


# sync_file_range(2) flags (linux/fs.h): wait for earlier write-out, start it, wait for it
_SFR_WAIT_BEFORE, _SFR_WRITE, _SFR_WAIT_AFTER = 1, 2, 4
_sync_file_range = None


def _libc_sync_file_range():
    """libc's sync_file_range through ctypes (the os module has none), or False."""
    global _sync_file_range
    if _sync_file_range is None:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _sync_file_range = (fn, ctypes)
        except (OSError, AttributeError):
            _sync_file_range = False
    return _sync_file_range


def write_out(fd: int, offset: int, length: int, path: str) -> None:
    """Write the dirty pages of ``[offset, offset + length)`` to the device and wait, so that
    POSIX_FADV_DONTNEED can then drop them: ``sync_file_range`` (no metadata, no flush of
    the device's cache: durability stays fdatasync's job); ``fdatasync`` where there is no
    sync_file_range. Lengths in bytes."""
    point("sync", path)
    if _recorder is not None:  # no durability (no metadata, no device cache flush)
        return _recorder.call("write_out", _write_out, (fd, offset, length, path), path, fd=fd)
    _write_out(fd, offset, length, path)


def _write_out(fd: int, offset: int, length: int, path: str) -> None:
    found = _libc_sync_file_range()
    if found:
        fn, ctypes = found
        if fn(fd, offset, length, _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), path)
    os.fdatasync(fd)
