"""``syscalls.makedirs(durable=True)`` fsyncs the parent of every directory it creates (a
new directory's name survives a power cut only then: issue 30, item 8), and the recorder
of io/syscalls.py sees every call that changes the disk, and none once it is off."""

from __future__ import annotations

import os

from offload_engine.io import syscalls

from helpers.fs_trace import FsTrace, read_log


def _calls(log: str) -> list[tuple[str, str]]:
    return [(line["op"], line["path"]) for line in read_log(log)]


def test_each_created_directory_has_its_parent_fsynced(tmp_path):
    root, log = tmp_path / "root", str(tmp_path / "log")
    os.makedirs(root / "there")
    with FsTrace(str(root), log):
        syscalls.makedirs(str(root / "there" / "a" / "b"), exist_ok=True, durable=True)
        syscalls.makedirs(str(root / "there" / "a" / "b"), exist_ok=True, durable=True)
        syscalls.makedirs(str(root / "plain"), exist_ok=True)
    assert _calls(log) == [("mkdir", "there/a"), ("mkdir", "there/a/b"),
                           ("sync", "there"), ("sync", "there/a"),   # made: its parent
                           ("mkdir", "plain")]                       # not asked to be durable
    assert os.path.isdir(root / "there" / "a" / "b")


def test_the_recorder_sees_changes_under_its_root_only_and_nothing_once_off(tmp_path):
    root, log = tmp_path / "root", str(tmp_path / "log")
    os.makedirs(root)
    outside = str(tmp_path / "outside")
    with FsTrace(str(root), log):
        fd = syscalls.open_fd(str(root / "f"), os.O_WRONLY | os.O_CREAT, 0o644)
        syscalls.write_all(fd, b"step-00000001\n", str(root / "f"))
        syscalls.fsync(fd, str(root / "f"))
        os.close(fd)
        syscalls.replace(str(root / "f"), str(root / "g"))
        syscalls.makedirs(outside)
        syscalls.unlink(str(root / "g"))
    syscalls.makedirs(str(root / "later"))
    lines = read_log(log)
    assert [(line["op"], line["path"]) for line in lines] == [
        ("create", "f"), ("write", "f"), ("sync", "f"), ("rename", "f"), ("unlink", "g")]
    assert lines[1]["data"] == "step-00000001\n" and lines[3]["dst"] == "g"
    assert syscalls._recorder is None
