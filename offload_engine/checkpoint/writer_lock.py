"""One writer per checkpoint folder: an exclusive ``flock`` on ``<ckpt_dir>/.writer-lock``.

Two runs saving into one folder (two trainings, or a job restarted while its old copy still
runs) would each drop the other's ``.partial`` staging folder, move ``latest`` back and
forth and remove each other's generations by ``keep_last``. So rank 0 of the saving run
takes this lock at its first save and holds it for the life of the run: until every
optimizer that saved into the folder from this process is closed or garbage collected,
or the process ends (the kernel releases a flock when its holder dies: a crashed or
killed run leaves no stale lock, and the next writer needs no manual step). The other ranks of the
run take no lock: their rank 0 holds it for them, and a refused rank 0 tells them
(save.py broadcasts its error). Readers (load, ``latest``, inspect, consolidate) take no
lock and never wait for one.

The lock is a file, not a flock on the folder itself (as the store's lock is): checkpoint
folders live on shared file systems, and NFS emulates flock by a byte-range lock that
needs a descriptor open for writing, which a directory cannot give. The holder writes its
pid, host and the time it took the lock into the file, so that a refused writer on another
node can name it (the kernel's lock table only knows local holders). The file is never
removed: removing it while held would let a second writer lock a new file of the same
name. Anything at that name that is not a plain file with one link (a symlink, a FIFO, a
hard link planted there) is refused, never opened through.

Within one process every save into a folder shares the one lock (a flock is per open file,
so a second one from the same process would refuse itself).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import functools
import json
import logging
import os
import socket
import stat
import threading
import weakref

from ..formats.errors import CheckpointError
from ..io import syscalls
from ..io.errors import FileIOError
from ..layout.checkpoint_names import WRITER_LOCK
from ..optim.close_callbacks import CLOSE_CALLBACKS
from ..store.lock import LockFileError, _describe_holder

log = logging.getLogger(__name__)

_INFO_BYTES = 4096       # the most read of a holder's note (bytes)
# errnos of a file system that cannot lock (Lustre without -o flock, NFS mounted nolock)
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class CheckpointLockedError(CheckpointError):
    """Another run (another process, or another job's rank 0) holds the checkpoint folder
    for writing; the message names its pid, host and since when. Nothing was written."""


class WriterLock:
    """The held lock of one checkpoint folder (``held`` False where the file system cannot
    lock: then nothing is guarded, and retention leaves ``.partial`` folders alone)."""

    def __init__(self, ckpt_dir: str, fd: int | None):
        self.ckpt_dir = ckpt_dir
        self.fd = fd
        self.held = fd is not None
        self.staging: set[str] = set()   # this process's saves in flight: never swept

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            self.held = False
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


_registry_lock = threading.Lock()
_held: dict[tuple[int, int], tuple[WriterLock, set[int]]] = {}  # folder -> (lock, owner ids)


def hold_for(ckpt_dir: str, owner) -> WriterLock:
    """The writer lock of ``ckpt_dir`` (made if missing), taken now or already held by this
    process, and kept at least as long as ``owner`` (the saving optimizer) lives.
    CheckpointLockedError naming the holder when another process holds it; FileIOError
    when the folder or the lock file cannot be made or opened."""
    try:
        syscalls.makedirs(ckpt_dir, exist_ok=True, durable=True)  # a power cut keeps it
        st = os.stat(ckpt_dir)
    except OSError as e:
        raise FileIOError(e.errno, "mkdir", ckpt_dir) from e
    key = (st.st_dev, st.st_ino)
    with _registry_lock:
        entry = _held.get(key)
        if entry is not None and entry[0].held and not _same_file(
                entry[0].fd, os.path.join(ckpt_dir, WRITER_LOCK)):
            # the folder was removed and made again (its inode number reused): the lock held
            # is the old file's; take the new one's for the same owners (none if refused)
            del _held[key]
            entry[0].release()
            entry = _held[key] = (_acquire(ckpt_dir), entry[1])
        if entry is None:
            lock = _acquire(ckpt_dir)
            try:  # a Ctrl-C/SIGTERM here must not leave the lock taken and unlisted
                entry = _held[key] = (lock, set())
            except BaseException:
                if _held.get(key, (None,))[0] is not lock:
                    lock.release()
                raise
        lock, owners = entry
        if id(owner) not in owners:
            owners.add(id(owner))
            weakref.finalize(owner, _drop_owner, key, id(owner))
            # and when it is closed (ZeroMuon.close runs these)
            owner.__dict__.setdefault(CLOSE_CALLBACKS, []).append(
                functools.partial(_drop_owner, key, id(owner)))
    return lock


class _OfflineWriter:
    """The owner of a lock an offline writer holds for one ``with`` block (``held``)."""


@contextlib.contextmanager
def held(ckpt_dir: str):
    """The writer lock of ``ckpt_dir`` for the duration of a ``with`` block: an offline
    writer of the folder (``import deepspeed``) is one writer like a training, refused
    (CheckpointLockedError naming the holder) while a run holds the folder, and refusing
    a run's save while it writes. Released at the block's end, however it ends."""
    owner = _OfflineWriter()
    lock = hold_for(ckpt_dir, owner)
    try:
        yield lock
    finally:
        for release in owner.__dict__.pop(CLOSE_CALLBACKS, []):
            release()


def _drop_owner(key: tuple[int, int], owner_id: int) -> None:
    """``owner`` was closed or collected: release the folder once no saving optimizer of
    this process is left (a second call for the same owner does nothing)."""
    with _registry_lock:
        entry = _held.get(key)
        if entry is None:
            return
        lock, owners = entry
        owners.discard(owner_id)
        if owners:
            return
        del _held[key]
    lock.release()


def _acquire(ckpt_dir: str) -> WriterLock:
    """Open (or create) the lock file, lock it without waiting and write the note."""
    path = os.path.join(ckpt_dir, WRITER_LOCK)
    for _ in range(8):  # the file replaced between open and lock: lock the new one
        fd = _open_lock_file(path)
        try:
            lock = _lock_open_file(ckpt_dir, path, fd)
        except _NoLocks:
            os.close(fd)
            return WriterLock(ckpt_dir, None)
        except BaseException:
            # refused, failed or interrupted (a signal's KeyboardInterrupt or SystemExit
            # between the flock and the return): closing the descriptor drops the flock, so
            # this process's next save is not refused by a lock it took and lost track of
            os.close(fd)
            raise
        if lock is not None:
            return lock
        os.close(fd)  # the name now holds another file: lock that one
    raise CheckpointError(f"{path}: replaced again and again while being locked; is "
                          f"something removing it?")


def _lock_open_file(ckpt_dir: str, path: str, fd: int) -> WriterLock | None:
    """Lock ``fd`` (the lock file ``path``, just opened) without waiting: the WriterLock
    owning ``fd``, or None when ``path`` was replaced meanwhile (the caller closes ``fd``
    and tries the new file). Raises CheckpointLockedError naming the holder."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = describe_holder(fd, path)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise CheckpointLockedError(
                f"checkpoint folder {ckpt_dir} is already being written by {holder}; a "
                f"checkpoint folder has one writer at a time: stop that run (a job "
                f"restarted while its old copy still runs?) or save into another folder "
                f"(readers such as load_checkpoint, inspect and consolidate are not "
                f"affected)") from None
        if e.errno in _NO_LOCKS:
            log.warning("%s: the file system cannot lock files (%s): this run saves "
                        "without a writer lock, and a second run writing into the same "
                        "folder would not be refused", ckpt_dir, errno.errorcode.get(
                            e.errno, e.errno))
            raise _NoLocks() from None
        raise FileIOError(e.errno, "lock", path) from e
    if not _same_file(fd, path):
        return None
    _write_note(fd, path)
    return WriterLock(ckpt_dir, fd)


class _NoLocks(Exception):
    """The file system cannot lock files (``_NO_LOCKS``): save without a writer lock."""


def _open_lock_file(path: str) -> int:
    """A read-write descriptor on the plain file ``path`` (created 0644 if missing), never
    through a symlink, never blocking on a FIFO; LockFileError for anything else there."""
    try:
        fd = syscalls.open_fd(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | syscalls.NOFOLLOW
                              | syscalls.CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise LockFileError(f"{path}: the checkpoint folder's writer lock is a symbolic "
                                f"link; refusing to open it (remove it)") from None
        raise FileIOError(e.errno, "open", path) from e
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        what = (f"mode {stat.filemode(st.st_mode)}" if not stat.S_ISREG(st.st_mode)
                else f"{st.st_nlink} hard links")
        raise LockFileError(f"{path}: the checkpoint folder's writer lock is not a plain file "
                            f"({what}); refusing to use the folder (offload-engine made no "
                            f"such thing: remove it)")
    return fd


def _same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file ``fd`` locked (no one replaced it meanwhile)."""
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _write_note(fd: int, path: str) -> None:
    """Who holds the lock, for a refused writer to read: best effort (a full disk still
    leaves the lock held; the refused writer then names the holder from /proc/locks)."""
    since = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    note = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since})
    data = (note + "\n").encode()
    try:
        syscalls.pwrite(fd, data, 0, path)  # then cut: a reader never sees an empty note
        syscalls.ftruncate(fd, len(data), path)
    except OSError as e:
        log.debug("%s: could not write the holder's note: %s", path, e)


def describe_holder(fd: int, path: str) -> str:
    """"process <pid> on <host> (holding it since <time>)" from the holder's note in the
    lock file ``path`` (open as ``fd``: read through it, never through a second descriptor,
    whose close would drop a lock NFS emulates by fcntl); from the kernel's lock table
    where the note cannot be read."""
    try:
        buf = bytearray(_INFO_BYTES)
        n = syscalls.preadv(fd, [buf], 0, path)
        raw = bytes(buf[:n]).decode("utf-8", "replace")
        note, _ = json.JSONDecoder().raw_decode(raw)  # a longer, older note may trail it
        pid, host, since = note["pid"], note["host"], note["since"]
        if type(pid) is int and isinstance(host, str) and isinstance(since, str):
            return f"process {pid} on {host!r} (holding it since {since})"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return _describe_holder(fd)



class StagingClaim:
    """A save's hold on its staging folder: listed as in flight (retention never sweeps
    it) and kept open, so that the commit can tell whether the folder under that name is
    still the one this save made (an open folder's inode number is never reused).
    ``release`` when the save ends, however it ends."""

    def __init__(self, lock: WriterLock, staging: str):
        self.lock = lock
        self.staging = staging
        self.fd = syscalls.open_fd(staging, os.O_RDONLY | os.O_DIRECTORY | syscalls.CLOEXEC)
        with _registry_lock:
            lock.staging.add(staging)

    def check(self) -> None:
        """CheckpointError unless the folder is still the one this save made: a writer
        that removed and made it again (one without the lock: a file system that cannot
        lock, a job whose rank 0 died while its other ranks wrote on) has put its own files
        there, and committing them would pass another run's weights off as this one's."""
        try:
            now = os.lstat(self.staging)
        except OSError:
            now = None
        made = os.fstat(self.fd)
        if now is None or (now.st_dev, now.st_ino) != (made.st_dev, made.st_ino):
            how = "removed" if now is None else "replaced"
            raise CheckpointError(f"{self.staging}: the staging folder was {how} by another "
                                  f"writer while this save wrote into it; not committed (save "
                                  f"again: a checkpoint folder takes one writer at a time)")

    def release(self) -> None:
        with _registry_lock:
            self.lock.staging.discard(self.staging)
            fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


def in_flight(lock: WriterLock) -> set[str]:
    """The staging folders of this process's saves in flight into the lock's folder."""
    with _registry_lock:
        return set(lock.staging)
