"""The steps publish takes in an output folder, recorded, and replayed under the pessimistic
model of a power cut: a directory's entries survive only as they were at its last fsync,
and of the steps since then any subset may have reached the disk (a file system that
journals nothing keeps no order). File data is not modelled: publish moves only files
consolidate fsynced (tests/offline/test_publish.py kills runs at every call as well)."""

import itertools
import os
import shutil

import offload_engine.offline.publish as publish_mod

from helpers.publish_runs import read_export


class Trace:
    """Record publish's renames, links, unlinks and directory fsyncs in ``out``: each step
    as ``(op, name, key)``, where ``key`` names a copy of the file's bytes."""

    def __init__(self, out: str, store: str, monkeypatch):
        self.out, self.store = os.path.abspath(out), store
        os.makedirs(store)
        self.steps: list[tuple] = []
        self.start = {e.name: self._keep(e.path) for e in os.scandir(out) if e.is_file()}
        real_replace, real_link = publish_mod.syscalls.replace, os.link
        real_unlink, real_sync = publish_mod.syscalls.unlink, publish_mod.fsync_dir

        def replace(src, dst):
            self._into(src, dst)
            real_replace(src, dst)

        def link(src, dst):
            self._into(src, dst)
            real_link(src, dst)

        def unlink(path):
            if self._here(path):
                self.steps.append(("unlink", os.path.basename(path), None))
            real_unlink(path)

        def sync(directory):
            if self._here(os.path.join(directory, "x")):
                self.steps.append(("sync", None, None))
            real_sync(directory)

        monkeypatch.setattr(publish_mod.syscalls, "replace", replace)
        monkeypatch.setattr(publish_mod.syscalls, "unlink", unlink)
        monkeypatch.setattr(publish_mod, "fsync_dir", sync)
        monkeypatch.setattr(os, "link", link)

    def _here(self, path) -> bool:
        return os.path.dirname(os.path.abspath(path)) == self.out

    def _keep(self, path) -> str:
        """A copy of ``path``'s bytes as they are moved (an inode number is reused once
        its file is gone, so copies are keyed by a count)."""
        key = str(len(os.listdir(self.store)))
        shutil.copyfile(path, os.path.join(self.store, key))
        return key

    def _into(self, src, dst) -> None:
        if self._here(dst):
            self.steps.append(("put", os.path.basename(dst), self._keep(src)))


def _apply(entries: dict, steps) -> dict:
    entries = dict(entries)
    for op, name, inode in steps:
        if op == "put":
            entries[name] = inode
        elif op == "unlink":
            entries.pop(name, None)
    return entries


def cut_states(trace: Trace, skip_sync: int | None = None):
    """Every folder a power cut could leave: ``(where, entries)`` for each step and each
    subset of the steps since the last fsync (``skip_sync``: the index of a sync step to
    leave out, as if publish did not make it). Last, the state after the run."""
    durable, pending, syncs = dict(trace.start), [], 0
    for i, step in enumerate(trace.steps):
        if step[0] == "sync":
            syncs += 1
            if syncs - 1 != skip_sync:
                durable, pending = _apply(durable, pending), []
            continue
        pending.append(step)
        for k in range(len(pending) + 1):
            for subset in itertools.combinations(pending, k):
                yield f"after step {i} ({step[0]} {step[1]}), {k} of {len(pending)} pending", \
                    _apply(durable, subset)
    yield "after the run returned", _apply(durable, [])


def load(trace: Trace, entries: dict, folder: str):
    """What a reader loads from a folder holding ``entries``."""
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    for name, inode in entries.items():
        os.link(os.path.join(trace.store, inode), os.path.join(folder, name))
    return read_export(folder)
