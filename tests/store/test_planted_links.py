"""Files we open under a fixed name (the lock file stores of earlier versions kept,
``latest``'s temporary file, the O_DIRECT probe) are never written through a symlink or
hard link someone planted there: as root, that would empty or overwrite any file of the
machine."""

from __future__ import annotations

import os

import pytest
import torch

from offload_engine.store import TieredStore
from offload_engine.store.lock import LEGACY_LOCK_NAME, LockFileError

B = 4096
SECRET = b"a file that is not ours\n"


def _victim(tmp_path) -> str:
    path = tmp_path / "victim"
    path.write_bytes(SECRET)
    return str(path)


def _store(path) -> TieredStore:
    return TieredStore(dict(nvme_paths=[str(path)], cpu_budget=4 * B, bucket_bytes=B))


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo", "directory"])
def test_an_old_lock_path_that_is_not_a_plain_file_is_refused_and_its_target_untouched(
        tmp_path, kind):
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    victim = _victim(tmp_path)
    lock = store_dir / LEGACY_LOCK_NAME
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


def test_the_lock_makes_no_file_and_an_earlier_versions_lock_file_is_removed(tmp_path):
    (tmp_path / LEGACY_LOCK_NAME).write_bytes(b'{"pid": 1}')  # as versions before kept it
    with _store(tmp_path) as s:
        s.register("m", torch.float32, B // 4)
        assert not (tmp_path / LEGACY_LOCK_NAME).exists()
    with _store(tmp_path) as s:        # reopened: the directory itself is what is locked
        s.register("m", torch.float32, B // 4)
    assert sorted(os.listdir(tmp_path)) == ["m", "zarr.json"]


def test_an_earlier_version_holding_its_lock_file_keeps_the_store(tmp_path):
    import fcntl
    from offload_engine.store import StoreLockedError
    lock = tmp_path / LEGACY_LOCK_NAME
    with open(lock, "wb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)    # what a writer of that version holds
        with pytest.raises(StoreLockedError, match="earlier offload-engine"):
            _store(tmp_path)
        assert lock.is_file()
    _store(tmp_path).close()                      # released: the old file is retired


def test_latest_is_never_written_through_a_planted_temporary_link(tmp_path):
    from offload_engine.checkpoint.checkpoint_dir import write_latest
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
