"""File descriptors follow the process's limit (issue 30, item 9b). Each file I/O object
cached up to 256 files' descriptors whatever RLIMIT_NOFILE was, so a store of 300 arrays
failed with EMFILE at `ulimit -n` a little over 256. The cache now keeps its share of half the
limit, and an open that meets EMFILE closes idle cached descriptors and tries again."""

import errno
import os
import subprocess
import sys
import textwrap

import pytest

from helpers.paths import ROOT
from offload_engine.io import AsyncFileIO, faults, fd_cache

# A child with a low descriptor limit: a store of many one-bucket arrays, each written home
# and read back; then most of the remaining descriptors taken by the "user", and more files
# read through a second AsyncFileIO: its opens meet EMFILE and must recover.
_CHILD = textwrap.dedent("""
    import os, resource, sys
    import torch
    from offload_engine.io import AsyncFileIO
    from offload_engine.store import TieredStore

    limit, arrays, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    B = 4096
    with TieredStore({"nvme_paths": [os.path.join(root, "store")], "cpu_budget": 4 * B,
                      "bucket_bytes": B, "prefetch_depth": 0, "io_threads": 2,
                      "queue_depth": 2}) as store:
        for i in range(arrays):
            store.register(f"a{i}", torch.float32, B // 4)
        for i in range(arrays):
            h = store.acquire(f"a{i}", 0)
            h.tensor.fill_(i)
            store.release(h, dirty=True)
        store.flush()
        for i in range(arrays):
            h = store.acquire(f"a{i}", 0)
            assert float(h.tensor[0]) == i, (i, float(h.tensor[0]))
            store.release(h)
        assert store.io.open_files <= limit // 4, store.io.open_files

        # the user takes descriptors until only a few are left: a cache sized before that
        # meets EMFILE, sheds its idle descriptors and goes on
        files = os.path.join(root, "files")
        os.makedirs(files)
        io = AsyncFileIO(threads=1, queue_depth=1)
        for i in range(40):
            io.write(os.path.join(files, str(i)), 0, bytes([i]) * B).result()
        taken = []
        try:
            while True:
                taken.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        for fd in taken[-6:]:
            os.close(fd)
        for i in range(40):
            out = bytearray(B)
            io.read(os.path.join(files, str(i)), 0, out).result()
            assert out == bytes([i]) * B
        io.close()
    print("ok", arrays)
""")


@pytest.mark.multiprocess
def test_many_arrays_under_a_low_descriptor_limit(tmp_path):
    limit, arrays = 200, 300
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(limit), str(arrays), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OFFLOAD_ENGINE_IO_PROBE": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["ok", str(arrays)]


def test_the_cache_takes_its_share_of_half_the_limit(monkeypatch):
    monkeypatch.setattr(fd_cache, "descriptor_limit", lambda: 1024)
    assert fd_cache.files_per_cache(256, 1) == 256
    assert fd_cache.files_per_cache(256, 2) == 128
    assert fd_cache.files_per_cache(256, 8) == 32
    assert fd_cache.files_per_cache(256, 10_000) == 1
    monkeypatch.setattr(fd_cache, "descriptor_limit", lambda: 64)
    with AsyncFileIO(threads=1) as a, AsyncFileIO(threads=1) as b:
        assert a._files.limit == b._files.limit <= 64 // 2 // 2 // 2


def test_an_open_out_of_descriptors_sheds_idle_ones_and_retries(tmp_path):
    with AsyncFileIO(threads=1, queue_depth=1, direct=False) as io:
        for i in range(5):
            io.write(str(tmp_path / f"f{i}"), 0, b"x" * 10).result()
        assert io.open_files == 5
        plan = faults.FaultPlan(kind="open", nth=1, times=1, errno=errno.EMFILE,
                                under=str(tmp_path))
        with faults.injected(plan):
            io.write(str(tmp_path / "new"), 0, b"y" * 10).result()
        assert plan.injected, "no open failed: the test exercised nothing"
        assert io.open_files == 1  # the idle ones were closed to make room
        assert (tmp_path / "new").read_bytes() == b"y" * 10


def test_out_of_descriptors_for_good_names_the_limit(tmp_path):
    from offload_engine.io import FileIOError
    with AsyncFileIO(threads=1, queue_depth=1, direct=False) as io:
        plan = faults.FaultPlan(kind="open", nth=1, times=None, errno=errno.EMFILE,
                                under=str(tmp_path))
        with faults.injected(plan), pytest.raises(FileIOError) as info:
            io.write(str(tmp_path / "new"), 0, b"y" * 10).result()
    assert info.value.errno == errno.EMFILE
    assert "RLIMIT_NOFILE" in str(info.value) and str(tmp_path / "new") in str(info.value)
