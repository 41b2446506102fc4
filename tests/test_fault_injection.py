"""The test-only fault layer (offload_engine/io/faults.py): a plan fails the chosen call."""

from __future__ import annotations

import errno

import pytest

from offload_engine.io import faults
from offload_engine.io.faults import FaultPlan


# -- the fault plan itself ------------------------------------------------------------------------------
def test_a_plan_fails_the_nth_matching_call_only_under_its_directory(tmp_path):
    from offload_engine.io import AsyncFileIO, FileIOError
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    elsewhere.mkdir()
    plan = FaultPlan(kind="write", nth=2, errno=errno.EIO, under=str(tmp_path))
    with AsyncFileIO(threads=1, queue_depth=1) as io, faults.injected(plan):
        io.write(str(elsewhere / "x"), 0, b"a" * 10).result()   # not under: not counted
        io.write(str(tmp_path / "a"), 0, b"a" * 10).result()    # the first: runs
        with pytest.raises(FileIOError) as info:
            io.write(str(tmp_path / "b"), 0, b"b" * 10).result()
        io.write(str(tmp_path / "c"), 0, b"c" * 10).result()    # times=1: the third runs
    assert info.value.errno == errno.EIO and str(tmp_path / "b") in str(info.value)
    assert [(k, p) for k, _, p in plan.injected] == [("write", str(tmp_path / "b"))]
    assert plan.calls[("write", "io.file_io._loop")] == 3
    assert faults._plan is None
