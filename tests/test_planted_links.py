"""Files we open for writing under a fixed name (the store's lock file, ``latest``'s
temporary file, the O_DIRECT probe) are never written through a symlink or hard link
someone planted there: as root, that would empty or overwrite any file of the machine."""

from __future__ import annotations

import os

import pytest
import torch

from offload_engine.store import TieredStore
from offload_engine.store.lock import LOCK_NAME, LockFileError

B = 4096
SECRET = b"a file that is not ours\n"


def _victim(tmp_path) -> str:
    path = tmp_path / "victim"
    path.write_bytes(SECRET)
    return str(path)


def _store(path) -> TieredStore:
    return TieredStore(dict(nvme_paths=[str(path)], cpu_budget=4 * B, bucket_bytes=B))


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo", "directory"])
def test_a_lock_path_that_is_not_a_plain_file_is_refused_and_its_target_untouched(tmp_path, kind):
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    victim = _victim(tmp_path)
    lock = store_dir / LOCK_NAME
    if kind == "symlink":
        os.symlink(victim, lock)
    elif kind == "hardlink":
        os.link(victim, lock)
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.mkdir()
    with pytest.raises(LockFileError) as info:
        _store(store_dir)
    assert str(lock) in str(info.value)
    with open(victim, "rb") as f:
        assert f.read() == SECRET, "the lock file's target was written to"


def test_a_lock_file_left_by_an_earlier_run_is_reused(tmp_path):
    with _store(tmp_path) as s:
        s.register("m", torch.float32, B // 4)
    assert (tmp_path / LOCK_NAME).is_file()
    with _store(tmp_path) as s:        # the plain file stays and is locked again
        s.register("m", torch.float32, B // 4)


def test_latest_is_never_written_through_a_planted_temporary_link(tmp_path):
    from offload_engine.checkpoint.generations import write_latest
    victim = _victim(tmp_path)
    ck = tmp_path / "ck"
    ck.mkdir()
    os.symlink(victim, ck / ".latest.tmp")   # the fixed name the writer once used
    write_latest(str(ck), "step-00000001")
    with open(victim, "rb") as f:
        assert f.read() == SECRET
    assert (ck / "latest").read_text() == "step-00000001\n"
    assert not (ck / "latest").is_symlink()


def test_the_direct_io_probe_never_writes_through_a_planted_link(tmp_path):
    from offload_engine.io.direct_probe import PROBE_NAME, probe_direct
    victim = _victim(tmp_path)
    d = tmp_path / "d"
    d.mkdir()
    os.symlink(victim, d / PROBE_NAME)
    probe_direct(str(d), strict=False)
    with open(victim, "rb") as f:
        assert f.read() == SECRET
    assert sorted(os.listdir(d)) == [PROBE_NAME]  # the probe removed its own file only
