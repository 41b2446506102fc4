"""Ctrl-C as a request is being queued leaves the I/O object's bookkeeping whole (issue 30,
BaseException-safe bookkeeping): before the fix the request counted as outstanding forever,
so the busy seconds the adaptive controller divides by never advanced again."""

import pytest

from offload_engine.io import AsyncFileIO


def test_ctrl_c_while_a_request_is_queued_keeps_the_busy_time_counting(tmp_path, monkeypatch):
    with AsyncFileIO(threads=1, queue_depth=1, direct=False) as io:
        enqueue = AsyncFileIO._enqueue

        def interrupted(self, *args):
            monkeypatch.setattr(AsyncFileIO, "_enqueue", enqueue)
            raise KeyboardInterrupt

        monkeypatch.setattr(AsyncFileIO, "_enqueue", interrupted)
        with pytest.raises(KeyboardInterrupt):
            io.write(str(tmp_path / "a"), 0, b"a" * 4096)
        before = io.stats.write_busy_s
        io.write(str(tmp_path / "b"), 0, b"b" * (1 << 20)).result()
        assert io.stats.write_busy_s > before
        assert (tmp_path / "b").read_bytes() == b"b" * (1 << 20)
