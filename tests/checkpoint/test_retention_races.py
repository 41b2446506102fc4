"""Readers racing ``keep_last``, and the clean-up of crashed writers' staging folders
(issue 30, items 9a and 10), and the writer lock's own rules in one process.

- A generation that retention removes while it is being read is reported as removed
  (``GenerationRemovedError``: load again), not as a corrupt checkpoint; a file missing from
  a generation that is still there stays corruption.
- ``latest`` moved on (and what it named removed) between the reader's look at it and its
  open: the reader follows ``latest`` again instead of failing.
- ``keep_last`` removes ``.partial`` folders of crashed writers while the run holds the
  folder's writer lock, never one of its own saves in flight, and none without the lock.
- A held lock refuses a writer with the holder's pid, host and time; an odd file planted at
  the lock's name is refused, never opened through."""

from __future__ import annotations

import fcntl
import json
import os
import socket

import pytest
import torch

from offload_engine.checkpoint import (CheckpointError, GenerationRemovedError, load_checkpoint,
                                       save_checkpoint)
from offload_engine.checkpoint.retention import apply_retention, sweep_stale_staging
from offload_engine.checkpoint.writer_lock import (CheckpointLockedError, StagingClaim,
                                                   WriterLock, hold_for)
from offload_engine.formats.ours import OursSource
from offload_engine.formats.ours import checkpoint_listing
from offload_engine.layout.checkpoint_names import WRITER_LOCK
from offload_engine.store.lock import LockFileError

from helpers.forged import fresh_model, train


def two_generations(tmp_path):
    """``ck`` with step-1 and step-2 (latest), and the parameters each was saved with."""
    ck = str(tmp_path / "ck")
    model, opt = fresh_model(str(tmp_path / "writer"))
    saved = {}
    for step in (1, 2):
        train(model, opt, [step])
        saved[step] = {n: p.detach().clone() for n, p in model.named_parameters()}
        save_checkpoint(ck, model, opt, step)
    opt.close()
    return ck, saved


@pytest.mark.parametrize("when", ["before the metadata check", "before the data"])
def test_a_generation_removed_by_keep_last_while_read_says_so(tmp_path, monkeypatch, when):
    ck, _ = two_generations(tmp_path)
    hook = "_before_data" if when == "before the metadata check" else "verify_metadata"
    real = getattr(OursSource, hook)

    def racing(self, *args):
        if hook == "verify_metadata":
            real(self, *args)
        apply_retention(ck, 1, "step-00000002")  # the writer's keep_last=1, right now
        if hook == "_before_data":
            real(self, *args)
    monkeypatch.setattr(OursSource, hook, racing)
    model, opt = fresh_model(str(tmp_path / "reader"), seed=5)
    with pytest.raises(GenerationRemovedError, match="step-00000001 was removed while being "
                                                     "read.*load again"):
        load_checkpoint(ck, model, opt, tag="step-00000001")
    opt.close()
    assert not os.path.exists(os.path.join(ck, "step-00000001"))


def test_a_file_missing_from_a_generation_still_there_is_corruption(tmp_path):
    ck, _ = two_generations(tmp_path)
    os.unlink(os.path.join(ck, "step-00000001", "rank0", "zarr.json"))
    model, opt = fresh_model(str(tmp_path / "reader"), seed=5)
    with pytest.raises(CheckpointError, match="missing") as info:
        load_checkpoint(ck, model, opt, tag="step-00000001")
    opt.close()
    assert not isinstance(info.value, GenerationRemovedError)


def test_latest_moved_on_and_its_old_generation_removed_before_the_open(tmp_path, monkeypatch):
    ck, saved = two_generations(tmp_path)
    apply_retention(ck, 1, "step-00000002")      # step-1 gone, latest names step-2
    real = checkpoint_listing.read_latest
    reads = []

    def stale_first(*args):  # the reader's first look was just before the save moved latest
        reads.append(1)
        return "step-00000001" if len(reads) == 1 else real(*args)
    monkeypatch.setattr(checkpoint_listing, "read_latest", stale_first)
    model, opt = fresh_model(str(tmp_path / "reader"), seed=5)
    assert load_checkpoint(ck, model, opt) == 2
    opt.close()
    assert all(torch.equal(p, saved[2][n]) for n, p in model.named_parameters())


def test_keep_last_removes_the_staging_folders_of_crashed_writers(tmp_path):
    ck = str(tmp_path / "ck")
    model, opt = fresh_model(str(tmp_path / "writer"))
    train(model, opt, [1])
    save_checkpoint(ck, model, opt, 1)
    for torn in ("step-00000007.partial", "best.partial"):  # as kill -9 mid-save leaves them
        os.makedirs(os.path.join(ck, torn, "rank0"))
        with open(os.path.join(ck, torn, "rank0", "zarr.json"), "w") as f:
            f.write("{}")
    train(model, opt, [2])
    save_checkpoint(ck, model, opt, 2, keep_last=2)
    opt.close()
    assert sorted(os.listdir(ck)) == [WRITER_LOCK, "latest", "step-00000001", "step-00000002"]


def test_the_sweep_keeps_saves_in_flight_and_needs_the_lock(tmp_path):
    ck = str(tmp_path / "ck")
    owner = torch.nn.Linear(1, 1)  # stands for the saving optimizer
    lock = hold_for(ck, owner)
    for name in ("step-00000003.partial", "step-00000004.partial"):
        os.makedirs(os.path.join(ck, name))
    os.symlink(str(tmp_path), os.path.join(ck, "link.partial"))  # never followed
    assert sweep_stale_staging(ck, WriterLock(ck, None)) == []  # no lock: a live writer's?
    claim = StagingClaim(lock, os.path.join(ck, "step-00000003.partial"))  # a save in flight
    assert sweep_stale_staging(ck, lock) == ["step-00000004.partial"]
    assert sorted(os.listdir(ck)) == [WRITER_LOCK, "link.partial", "step-00000003.partial"]
    claim.release()
    assert sweep_stale_staging(ck, lock) == ["step-00000003.partial"]
    assert os.listdir(tmp_path)  # the link's target is untouched


def test_a_held_lock_refuses_with_the_holders_pid_host_and_time(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    fd = os.open(ck / WRITER_LOCK, os.O_RDWR | os.O_CREAT, 0o644)  # another writer's lock
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps({"pid": 4242, "host": "node7",
                                 "since": "2026-12-04 01:02:03 UTC"}).encode())
        with pytest.raises(CheckpointLockedError) as info:
            hold_for(str(ck), torch.nn.Linear(1, 1))
        msg = str(info.value)
        assert "process 4242 on 'node7' (holding it since 2026-12-04 01:02:03 UTC)" in msg
        assert str(ck) in msg and "\n" not in msg
        os.ftruncate(fd, 0)  # no note yet (the holder is writing it): the kernel's table
        with pytest.raises(CheckpointLockedError,
                           match=f"process {os.getpid()} on {socket.gethostname()}"):
            hold_for(str(ck), torch.nn.Linear(1, 1))
    finally:
        os.close(fd)
    owner = torch.nn.Linear(1, 1)
    lock = hold_for(str(ck), owner)  # the holder is gone: taken, no manual step
    assert lock.held
    with open(ck / WRITER_LOCK) as f:
        assert json.load(f)["pid"] == os.getpid()
    del owner  # the last saving object of this process gone: the folder is free again
    assert not lock.held


@pytest.mark.parametrize("planted", ["symlink", "fifo", "hardlink"])
def test_an_odd_file_at_the_locks_name_is_refused(tmp_path, planted):
    ck = tmp_path / "ck"
    ck.mkdir()
    target = tmp_path / "precious"
    target.write_text("keep me")
    if planted == "symlink":
        os.symlink(target, ck / WRITER_LOCK)
    elif planted == "fifo":
        os.mkfifo(ck / WRITER_LOCK)
    else:
        os.link(target, ck / WRITER_LOCK)
    with pytest.raises(LockFileError, match="writer lock"):
        hold_for(str(ck), torch.nn.Linear(1, 1))
    assert target.read_text() == "keep me"


def test_a_folder_removed_and_made_again_is_locked_anew(tmp_path):
    import shutil
    ck = tmp_path / "ck"
    owner = torch.nn.Linear(1, 1)
    hold_for(str(ck), owner)
    shutil.rmtree(ck)  # its inode number may be reused by the new folder (tmpfs does)
    lock = hold_for(str(ck), owner)
    assert lock.held
    fd = os.open(ck / WRITER_LOCK, os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: by this process's lock
    finally:
        os.close(fd)


def test_a_file_system_that_cannot_lock_saves_with_a_warning_and_sweeps_nothing(
        tmp_path, monkeypatch, caplog):
    import errno
    import logging
    from offload_engine.checkpoint import writer_lock

    class NoLocks:  # fcntl on a file system mounted without locking (Lustre, NFS nolock)
        LOCK_EX, LOCK_NB, LOCK_UN = fcntl.LOCK_EX, fcntl.LOCK_NB, fcntl.LOCK_UN

        @staticmethod
        def flock(fd, op):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(writer_lock, "fcntl", NoLocks)
    ck = str(tmp_path / "ck")
    os.makedirs(os.path.join(ck, "step-00000009.partial"))  # a live writer's, for all we know
    model, opt = fresh_model(str(tmp_path / "writer"))
    with caplog.at_level(logging.WARNING):
        for step in (1, 2, 3):
            train(model, opt, [step])
            save_checkpoint(ck, model, opt, step, keep_last=1)
    opt.close()
    warned = [r for r in caplog.records if "without a writer lock" in r.message]
    assert len(warned) == 1  # once for the run, not at every save
    assert sorted(os.listdir(ck)) == [WRITER_LOCK, "latest", "step-00000003",
                                      "step-00000009.partial"]


def test_closing_the_optimizer_that_saved_frees_the_folder(tmp_path):
    ck = str(tmp_path / "ck")
    model, opt = fresh_model(str(tmp_path / "writer"))
    train(model, opt, [1])
    save_checkpoint(ck, model, opt, 1)
    fd = os.open(os.path.join(ck, WRITER_LOCK), os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while opt is open
        opt.close()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)      # free: another run may take it
    finally:
        os.close(fd)
