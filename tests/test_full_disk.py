"""A full disk (ENOSPC) during a step or a save: the error reaches the caller naming what
failed, no byte the store holds is lost, and once the disk has room again the next step,
flush, save and close work (docs/store.md and docs/checkpoint.md, "Faults").

The exhaustive sweep over every call site is tests/test_fault_injection.py; these are the
scenarios of the review that found the defects, one test each. The last one runs on a
real 20 MiB tmpfs, where the machine lets us mount one (in a private mount namespace).
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

import fault_scenarios as fs
from offload_engine.io import AsyncFileIO, FileIOError
from offload_engine.layout import FlatArray

B = 4096


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_chunk_whose_first_write_fails_is_left_absent(tmp_path, code):
    """The fallocate of a chunk's first write fails after its file was created: the file
    is removed, so the chunk still reads as the fill value (a 0-byte file left there read
    as a truncated chunk, making the array unreadable after a restart) and a later write
    creates it again."""
    from offload_engine.io.faults import FaultPlan, injected
    with AsyncFileIO(threads=1, queue_depth=1) as io:
        arr = FlatArray.create(str(tmp_path / "a"), 2 * B // 4, torch.float32, io=io,
                               chunk_bytes=B)
        data = torch.arange(B // 4, dtype=torch.float32) + 1
        plan = FaultPlan(kind="allocate", errno=code, under=str(tmp_path))
        with injected(plan), pytest.raises(OSError) as info:
            arr.write(0, data)
        assert plan.injected and info.value.errno == code
        assert not os.path.exists(arr.chunk_path(0)), "a failed first write left a chunk file"
        again = FlatArray.open(str(tmp_path / "a"), io=io, mode="r")
        assert torch.equal(again.read(), torch.zeros(2 * B // 4))
        arr.write(0, data)                                   # room again
        reopened = FlatArray.open(str(tmp_path / "a"), io=io, mode="r")
        assert torch.equal(reopened.read(0, B // 4), data)


def test_a_full_disk_during_save_names_the_file_and_the_rank(tmp_path):
    """Defect 7a: ENOSPC while the save writes its metadata (create_group ->
    write_text_atomic) was a bare ``OSError: [Errno 28]`` naming no file and no rank. Now
    it is an OSError (a CheckpointSaveError) saying which generation, rank, operation and
    file; the generation before it stays the loadable one, and the next save works."""
    from offload_engine.checkpoint import (CheckpointSaveError, load_checkpoint,
                                           save_checkpoint)
    from offload_engine.io.faults import FaultPlan, injected
    ck = str(tmp_path / "ck")
    model, opt = fs.make_optimizer(str(tmp_path / "state"))
    fs.set_grads(model, 0)
    opt.step()
    save_checkpoint(ck, model, opt, 1)
    gen1 = fs.capture(model, opt)
    plan = FaultPlan(kind="write", site="layout.metadata.write_text_atomic", errno=errno.ENOSPC,
                     times=None, under=ck)
    with injected(plan), pytest.raises(CheckpointSaveError) as info:
        save_checkpoint(ck, model, opt, 2)
    err, text = info.value, str(info.value)
    assert plan.injected, "no fault was injected"
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert "rank 0" in text and "step-00000002" in text and "ENOSPC" in text, text
    assert os.path.join(ck, "step-00000002.partial") in text and "zarr.json" in text, text
    assert open(os.path.join(ck, "latest")).read().strip() == "step-00000001"
    save_checkpoint(ck, model, opt, 3)                # room again: the next save commits
    m2, o2 = fs.make_optimizer(str(tmp_path / "load"), seed=77)
    assert load_checkpoint(ck, m2, o2, tag="step-00000001") == 1
    fs.assert_same(m2, o2, gen1, "generation 1")
    o2.close()
    opt.close()
