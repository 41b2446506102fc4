"""Record the file-system calls of real saves, in order, across threads and processes.

``FsTrace(root, log)`` is the recorder ``offload_engine.io.syscalls.record_calls`` takes: it
makes each call that changes the disk and appends one JSON line to ``log`` for it (calls
on paths outside ``root`` run unrecorded). Every process of a run opens the same log with
O_APPEND and holds an flock on it (and a thread lock) from before the call until its line
is written, so the log's order is the order in which the calls took effect, whichever
rank or thread made them. ``mark(what, **info)`` adds a line of the test's own (say, a save
that returned to its caller).

A line: ``op`` (create, mkdir, write, sync, write_out, rename, unlink, rmtree, mark), paths
relative to ``root``, the inode a descriptor call acted on, the bytes ``write_all`` wrote
(small files: ``latest`` is read back from them) and ``site``: the engine functions on the
stack, innermost first. tests/helpers/power_cut.py replays the log.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import sys
import threading
import time

from offload_engine.io import syscalls
from offload_engine.io.syscalls import _missing_dirs  # what makedirs will create

DATA_LIMIT = 64 * 1024     # bytes of a write kept in the log (latest, JSON files)
SITE_FRAMES = 12           # engine frames kept per call


class FsTrace:
    def __init__(self, root: str, log: str, pause_after=None):
        """``pause_after(line) -> seconds``: sleep that long after the call of ``line``
        (outside the lock), to let other processes run into a window the call opens."""
        self.pause_after = pause_after
        self.root = os.path.abspath(root)
        self._prefix = os.path.join(self.root, "")
        self._fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._lock = threading.Lock()

    # -- installing ---------------------------------------------------------------------------
    def __enter__(self) -> "FsTrace":
        syscalls.record_calls(self)
        return self

    def __exit__(self, *exc) -> None:
        syscalls.record_calls(None)
        os.close(self._fd)

    # -- the recorder -------------------------------------------------------------------------
    def _rel(self, path) -> str | None:
        path = os.path.abspath(os.fspath(path))
        if path == self.root:
            return ""
        return path[len(self._prefix):] if path.startswith(self._prefix) else None

    def call(self, op, fn, args, path, fd=None, dst=None, data=None):
        rel, rel_dst = self._rel(path), (None if dst is None else self._rel(dst))
        if rel is None and rel_dst is None:
            return fn(*args)
        site = _site()
        pause = 0.0
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                missing = _missing_dirs(path) if op == "mkdir" else []
                existed = os.path.lexists(path) if op == "create" else True
                result = fn(*args)
                for line in self._lines(op, rel, rel_dst, fd, data, result, missing, existed,
                                        args):
                    line["site"] = site
                    self._write(line)
                    pause += self.pause_after(line) if self.pause_after else 0.0
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        if pause:
            time.sleep(pause)
        return result

    def _lines(self, op, rel, rel_dst, fd, data, result, missing, existed, args):
        if rel is None or (op == "rename" and rel_dst is None):
            raise AssertionError(f"{op} across the traced root {self.root}: {rel} -> {rel_dst}")
        if op == "create":
            ino = os.fstat(result).st_ino
            if not existed:
                yield {"op": "create", "path": rel, "ino": ino}
            elif args[1] & os.O_TRUNC:
                yield {"op": "write", "ino": ino, "path": rel}
        elif op == "symlink":
            yield {"op": "create", "path": rel, "ino": os.lstat(args[1]).st_ino, "link": True}
        elif op == "mkdir":
            for d in missing:
                yield {"op": "mkdir", "path": self._rel(d), "ino": os.lstat(d).st_ino}
        elif op in ("write", "allocate", "truncate"):
            line = {"op": "write", "ino": os.fstat(fd).st_ino, "path": rel}
            if data is not None and len(data) <= DATA_LIMIT:
                line["data"] = data[:result].decode("latin-1")
            yield line
        elif op in ("fsync", "fdatasync", "write_out"):
            st = os.fstat(fd)
            yield {"op": "sync" if op != "write_out" else "write_out", "ino": st.st_ino,
                   "dir": stat.S_ISDIR(st.st_mode), "path": rel}
        elif op == "rename":
            yield {"op": "rename", "path": rel, "dst": rel_dst}
        elif op in ("unlink", "rmtree"):
            yield {"op": op, "path": rel}
        else:
            raise AssertionError(f"unknown recorded call {op}")

    def mark(self, what: str, **info) -> None:
        """A line of the test's own at this point of the sequence."""
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                self._write({"op": "mark", "what": what, **info})
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _write(self, line: dict) -> None:
        line["pid"] = os.getpid()
        os.write(self._fd, (json.dumps(line) + "\n").encode())


def read_log(log: str) -> list[dict]:
    with open(log) as f:
        return [json.loads(line) for line in f]


def _site() -> list[str]:
    """``module.function`` of the engine frames on the stack, innermost first."""
    frames, frame = [], sys._getframe(2)
    while frame is not None and len(frames) < SITE_FRAMES:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("offload_engine.") and module != "offload_engine.io.syscalls":
            frames.append(f"{module.removeprefix('offload_engine.')}.{frame.f_code.co_name}")
        frame = frame.f_back
    return frames
