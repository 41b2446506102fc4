"""Swap a new Hugging Face export into an output folder so that a crash cannot half-finish it.

Readers decide what a folder holds as transformers' ``from_pretrained`` does:
``model.safetensors`` when it is there, else ``model.safetensors.index.json`` and the shard
files its ``weight_map`` names (``live_files``). Publishing keeps, at every instant, the
files of one complete export where those readers look; each step is one rename or unlink
(atomic in POSIX), and the fsyncs below order them on disk, so a SIGKILL or a power cut
leaves the earlier export or the new one, whole:

- every new file is complete and fsynced in the staging folder (inside OUT, so renames
  never cross a file system) before anything in OUT changes;
- one export, one file: renaming ``model.safetensors`` over the old one is the commit;
- sharded: new shards go in under names no file of the live export has, the directory is
  fsynced, then the index is renamed in: the commit (when the live export is one file,
  unlinking ``model.safetensors`` is the commit, as readers look at it first). When the
  new shard names are the live export's own (same shard count), the shards are linked in
  under tagged names (``model-00001-of-00004.<tag>.safetensors``), an index naming those
  commits, then the shards are renamed over the old names (other links of the same
  files) and the index naming them commits again. Where hard links are refused, the
  tagged names stay (a warning says so; the next run goes back to the plain names);
- only after the commit are the earlier export's files unlinked, and then whatever
  matches the output names and is not part of the new export (files a crashed run left).

A run that fails before its commit removes what it put into OUT; after its commit the new
export stands and the error is reported. Files in OUT that are not ours (``config.json``)
are never touched.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import secrets

from ..formats.safetensors import INDEX_FILE
from ..io import syscalls
from ..io.errors import FileIOError, WrappedIOError
from ..io.faults import point
from ..layout.metadata import fsync_dir
from .hf_shards import SINGLE_FILE, index_text

log = logging.getLogger(__name__)

# every name an export of ours may leave in OUT: the single file, shards (plain or tagged)
# and the index; anything else there is someone else's
OUTPUT_FILE_PATTERN = re.compile(
    r"^model(-\d{5}-of-\d{5}(\.[0-9a-f]{8})?)?\.safetensors$|^model\.safetensors\.index\.json$")
_INDEX_BYTES = 256 * 2**20  # the most read of an existing index (a 1T-parameter model's is ~5 MB)
_STAGED_INDEX = "tagged." + INDEX_FILE  # the index naming tagged shards, in the staging folder
# errnos of a file system that has no hard links (FAT, some FUSE and network mounts)
_NO_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS})


class PublishError(WrappedIOError):
    """A step of publishing failed; ``context`` says whether OUT kept the earlier export."""


def output_files(out_dir: str) -> set[str]:
    """Names in ``out_dir`` that an export of ours may have written (not directories)."""
    found = set()
    for entry in os.scandir(out_dir):
        if OUTPUT_FILE_PATTERN.match(entry.name) and not entry.is_dir(follow_symlinks=False):
            found.add(entry.name)
    return found


def live_files(out_dir: str) -> set[str] | None:
    """The files of the export a reader of ``out_dir`` loads now (see the module's
    docstring): ``{"model.safetensors"}``, or the index and its shards, or nothing. None
    when the index cannot be read as one (then every output name counts as in use)."""
    if os.path.isfile(os.path.join(out_dir, SINGLE_FILE)):
        return {SINGLE_FILE}
    path = os.path.join(out_dir, INDEX_FILE)
    if not os.path.isfile(path):
        return set()
    try:
        raw = syscalls.read_all(path, _INDEX_BYTES, flags=syscalls.NOFOLLOW)
        weight_map = json.loads(raw)["weight_map"] if len(raw) <= _INDEX_BYTES else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(weight_map, dict):
        return None
    return {INDEX_FILE} | {f for f in weight_map.values() if isinstance(f, str)}


def tagged_name(shard: str, tag: str) -> str:
    """``model-00001-of-00004.safetensors`` as ``model-00001-of-00004.<tag>.safetensors``."""
    return f"{shard[:-len('.safetensors')]}.{tag}.safetensors"


def publish(staging: str, out_dir: str, files: list[str], index: dict | None) -> list[str]:
    """Move the export in ``staging`` (``files``: fsynced shards or the single file, by
    name) into ``out_dir``, writing ``index`` beside it when sharded, with the one commit
    point of the module's docstring. The caller holds ``out_dir``'s ``OutputLock``.
    Returns the names published: the files in order (tagged where hard links were
    refused), then the index."""
    step = _Steps(staging, out_dir)
    live = live_files(out_dir)
    present = output_files(out_dir)
    in_use = present if live is None else live
    final = list(files)
    try:
        if index is None:
            step.move(SINGLE_FILE, SINGLE_FILE, commit=True)
        else:
            final = _publish_shards(step, files, index, in_use, present)
        # Transformers looks at model.safetensors first: as long as it is there, it is the
        # export. A sharded export commits by unlinking it.
        if index is not None and os.path.isfile(os.path.join(out_dir, SINGLE_FILE)):
            step.sync()  # the index's entry on disk before the file that hides it goes
            step.unlink(SINGLE_FILE, commit=True)
        step.sync()
    except BaseException as e:
        step.roll_back()
        wrapped = step.wrapped(e)
        if wrapped is e:
            raise
        raise wrapped from None
    names = final + ([INDEX_FILE] if index is not None else [])
    _remove_left_over(step, set(names))
    return names


def _publish_shards(step: "_Steps", files: list[str], index: dict, in_use: set[str],
                    present: set[str]) -> list[str]:
    """Shards and index into OUT; the names of the shards as published."""
    single_is_live = SINGLE_FILE in in_use
    if not any(name in in_use for name in files):
        for name in files:
            step.move(name, name)
        step.stage_index(INDEX_FILE, index)
        if not single_is_live:  # else the sync before model.safetensors goes orders them
            step.sync()
        step.move(INDEX_FILE, INDEX_FILE, commit=not single_is_live)
        return list(files)
    tag = _fresh_tag(present)
    tagged = {name: tagged_name(name, tag) for name in files}
    linked = True
    for name in files:
        if linked:
            linked = step.link(name, tagged[name])
        else:
            step.move(name, tagged[name])
    step.stage_index(_STAGED_INDEX, _renamed(index, tagged))
    step.sync()
    step.move(_STAGED_INDEX, INDEX_FILE, commit=not single_is_live)
    if not linked:
        log.warning("%s: the file system refused a hard link; the shards keep their tagged "
                    "names (%s), which the index names (the next run writes plain names)",
                    step.out_dir, ", ".join(tagged[n] for n in files))
        return [tagged[n] for n in files]
    step.sync()
    for name in files:  # the staged name is a second link of the tagged file
        step.move(name, name, placed=False)
    step.stage_index(INDEX_FILE, index)
    step.sync()
    step.move(INDEX_FILE, INDEX_FILE)
    return list(files)


def _remove_left_over(step: "_Steps", keep: set[str]) -> None:
    """After the commit: unlink every output name of OUT that the new export does not use
    (the earlier export, tagged names, a crashed run's files), the index first so that no
    index names a shard already gone; then fsync OUT."""
    left = sorted(output_files(step.out_dir) - keep, key=lambda n: n != INDEX_FILE)
    try:
        for name in left:
            step.unlink(name)
        if left:
            step.sync()
    except OSError as e:
        raise PublishError.wrap(e, f"{step.out_dir}: the new export is in place, but removing "
                                   f"the earlier export's files failed (the next run removes "
                                   f"them)") from None


def _fresh_tag(present: set[str]) -> str:
    while True:
        tag = secrets.token_hex(4)
        if not any(tag in name for name in present):
            return tag


def _renamed(index: dict, names: dict[str, str]) -> dict:
    return {**index, "weight_map": {k: names[v] for k, v in index["weight_map"].items()}}


class _Steps:
    """The file system steps of one publish, each through io/syscalls (so tests can fail
    or interrupt any one), remembering what went into OUT before the commit."""

    def __init__(self, staging: str, out_dir: str):
        self.staging, self.out_dir = staging, out_dir
        self.placed: list[str] = []   # names put into OUT, removed again if no commit follows
        self.committed = False

    def move(self, src: str, dst: str, commit: bool = False, placed: bool = True) -> None:
        if placed and not self.committed and not commit:
            self.placed.append(dst)
        syscalls.replace(os.path.join(self.staging, src), os.path.join(self.out_dir, dst))
        self.committed |= commit

    def link(self, src: str, dst: str) -> bool:
        """Hard-link a staged file into OUT as ``dst``; False (and the file moved there
        instead) where the file system has no hard links."""
        path = os.path.join(self.out_dir, dst)
        self.placed.append(dst)
        try:
            point("link", path)
            os.link(os.path.join(self.staging, src), path)
            return True
        except OSError as e:
            if e.errno not in _NO_LINKS:
                raise
        self.move(src, dst, placed=False)
        return False

    def unlink(self, name: str, commit: bool = False) -> None:
        syscalls.unlink(os.path.join(self.out_dir, name))
        self.committed |= commit

    def stage_index(self, name: str, index: dict) -> None:
        path = os.path.join(self.staging, name)
        fd = syscalls.open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | syscalls.NOFOLLOW
                              | syscalls.CLOEXEC, 0o644)
        try:
            syscalls.write_all(fd, index_text(index).encode("utf-8"), path)
            syscalls.fsync(fd, path)
        finally:
            os.close(fd)

    def sync(self) -> None:
        fsync_dir(self.out_dir)

    def roll_back(self) -> None:
        """Before the commit: unlink what this run put into OUT (best effort; the next run
        removes what is left). After it: nothing, the new export stands."""
        if self.committed:
            return
        for name in reversed(self.placed):
            try:
                os.unlink(os.path.join(self.out_dir, name))
            except OSError:
                pass

    def wrapped(self, error: BaseException) -> BaseException:
        if not isinstance(error, OSError) or isinstance(error, PublishError):
            return error
        state = ("the new export is in place" if self.committed
                 else "it keeps its earlier export, if it had one")
        return PublishError.wrap(error, f"{self.out_dir}: publishing the new export failed; {state}")
