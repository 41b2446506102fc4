"""Exports for the publish tests: sources as safetensors files, a reader that loads an
output folder as transformers does (``model.safetensors`` first, else the index), and a
fault plan that stops a run at its n-th file system call in the output folder."""

import os
import shutil
import threading

import numpy as np
from safetensors.numpy import load_file, save_file

from offload_engine.formats import open_source
from offload_engine.formats.safetensors import INDEX_FILE
from offload_engine.offline.consolidate import consolidate

SINGLE = "model.safetensors"
TENSOR_BYTES = 80  # every test tensor: 20 float32


def tensors(base: float, count: int = 6) -> dict:
    """``count`` tensors of 20 float32 each, their values from ``base`` (one export's)."""
    return {f"layer{i}.weight": np.arange(20, dtype=np.float32) + base + i for i in range(count)}


def shard_limit(per_shard: int | None) -> int:
    """The --max-shard-size that puts ``per_shard`` test tensors in a shard (None: one file)."""
    return 10**6 if per_shard is None else per_shard * TENSOR_BYTES


def write_source(path: str, data: dict) -> str:
    save_file(data, path)
    return path


def export(src: str, out: str, per_shard: int | None) -> list[str]:
    """consolidate ``src`` into ``out``; the names it wrote."""
    with open_source(src) as source:
        return consolidate(source, out, max_shard_bytes=shard_limit(per_shard)).files


def read_export(out: str) -> dict | None:
    """{name: array} of the export a transformers reader loads from ``out``, None when there
    is none; an index naming a missing shard fails (that export is broken)."""
    single = os.path.join(out, SINGLE)
    if os.path.isfile(single):
        return load_file(single)
    index = os.path.join(out, INDEX_FILE)
    if not os.path.isfile(index):
        return None
    import json

    weight_map = json.load(open(index))["weight_map"]
    loaded = {}
    for name in sorted(set(weight_map.values())):
        part = load_file(os.path.join(out, name))  # FileNotFoundError: a broken export
        assert not set(part) & set(loaded), name
        loaded.update(part)
    assert set(loaded) == set(weight_map), "the index and its shards disagree"
    return loaded


def same(a: dict | None, b: dict) -> bool:
    return a is not None and set(a) == set(b) and all(
        a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in b)


def ours(out: str) -> list[str]:
    """The names in ``out`` that are not the user's (everything but ``config.json``)."""
    return sorted(n for n in os.listdir(out) if n != "config.json")


class StopAt:
    """A fault plan (``faults.arm``) that counts the file system calls under ``out`` and, at
    the ``nth``, copies what ``out`` holds to ``snapshot`` (its files: what a reader sees
    after a SIGKILL just before that call) and fails the call with EIO. ``nth=0`` counts."""

    def __init__(self, out: str, nth: int = 0, snapshot: str | None = None):
        self.under = os.path.join(os.path.abspath(out), "")
        self.nth, self.snapshot = nth, snapshot
        self.count, self.stopped_at = 0, None
        self._lock = threading.Lock()

    def hit(self, kind: str, path) -> None:
        path = os.path.abspath(os.fspath(path))
        if not (path + os.sep).startswith(self.under):
            return
        with self._lock:
            self.count += 1
            if self.count != self.nth:
                return
            self.stopped_at = (kind, path)
            if self.snapshot is not None:
                os.makedirs(self.snapshot)
                for entry in os.scandir(self.under):
                    if entry.is_file(follow_symlinks=False):
                        shutil.copy2(entry.path, os.path.join(self.snapshot, entry.name))
        raise OSError(5, os.strerror(5), path)
