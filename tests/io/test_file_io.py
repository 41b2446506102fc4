import asyncio
import errno
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from offload_engine.io import (AsyncFileIO, BufferPool, FileIOError, IOFuture, TruncatedFileError,
                               probe_direct)
from offload_engine.io import file_io as file_io_mod
from offload_engine.io.settings import DirectionSettings
from offload_engine import dtypes
from helpers.paths import ROOT


# every mode and every mix of modes per direction (buffered reads with direct writes, ...),
# and requests served several at once (streams)
MODES = {"direct": ("direct", "direct"), "buffered": ("buffered", "buffered"),
         "buffered-reads": ("buffered", "direct"), "buffered-writes": ("direct", "buffered"),
         "streams": ("direct", "buffered", 3)}


def _io(read_mode: str = "direct", write_mode: str = "direct", streams: int = 1,
        **kw) -> AsyncFileIO:
    kw = {"threads": 3, "queue_depth": 2, "block_size": 64 << 10, **kw}
    return AsyncFileIO(read=DirectionSettings(read_mode, kw["queue_depth"], kw["block_size"],
                                              "config", streams),
                       write=DirectionSettings(write_mode, kw["queue_depth"], kw["block_size"],
                                               "config", streams),
                       **kw)


@pytest.fixture(params=sorted(MODES))
def fio(request):
    with _io(*MODES[request.param]) as io:
        yield io


@pytest.fixture
def direct_fio():
    with _io() as io:
        yield io


def _pattern(nbytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("nbytes,offset", [(0, 0), (1, 0), (4095, 0), (4096, 4096),
                                           (4097, 8192), (1 << 20, 0), ((1 << 20) + 17, 3)])
def test_round_trip_aligned_and_unaligned(fio, tmp_path, nbytes, offset):
    path = tmp_path / "f"
    src = _pattern(nbytes)
    assert fio.write(path, offset, src, sync=True).result() == nbytes
    out = torch.empty(nbytes, dtype=torch.uint8)
    assert fio.read(path, offset, out).result() == nbytes
    assert torch.equal(out, src)
    if nbytes:
        assert os.path.getsize(path) == offset + nbytes


def test_pooled_buffers_use_o_direct_where_supported(direct_fio, tmp_path):
    fio = direct_fio
    pool = BufferPool(1 << 20)
    buf = pool.acquire(256 << 10)
    buf.bytes.copy_(_pattern(256 << 10, 1))
    fio.write(tmp_path / "d", 0, buf).result()
    back = pool.acquire(256 << 10)
    fio.read(tmp_path / "d", 0, back).result()
    assert torch.equal(back.bytes, buf.bytes)
    if fio.uses_direct(tmp_path / "d"):
        assert fio.stats.direct_pieces == 8 and fio.stats.buffered_pieces == 0


@pytest.mark.parametrize("nbytes", [3 * 4096 + 100, (128 << 10) + 3 * 4096 + 100])
def test_page_aligned_request_buffers_only_its_sub_page_tail(direct_fio, tmp_path, nbytes):
    """A request at a page-aligned offset from a page-aligned buffer whose length is not
    whole pages: all but the last partial page moves with O_DIRECT (the last block is cut
    at its last page boundary), so one piece of < 4096 bytes goes through the page cache."""
    fio = direct_fio
    path = tmp_path / "t"
    pool = BufferPool(1 << 20)
    buf = pool.acquire(nbytes)
    want = _pattern(nbytes, 5)
    buf.bytes.copy_(want)
    assert fio.write(path, 0, buf).result() == nbytes
    wrote = fio.reset_stats()
    with open(path, "rb") as f:
        assert f.read() == bytes(want.numpy())
    back = pool.acquire(nbytes)
    assert fio.read(path, 0, back).result() == nbytes
    assert torch.equal(back.bytes, want)
    read = fio.reset_stats()
    # False: the tmp file system refused O_DIRECT (None would mean it was never tried)
    if fio.uses_direct(path) is not False:
        whole_blocks = nbytes // (64 << 10)
        for stats in (wrote, read):
            assert stats.direct_pieces == whole_blocks + 1, stats
            assert stats.buffered_pieces == 1, stats


def test_any_dtype_tensor_including_bfloat16(fio, tmp_path):
    src = torch.randn(1000).to(torch.bfloat16)
    fio.write(tmp_path / "b", 0, src).result()
    out = torch.empty(1000, dtype=torch.bfloat16)
    fio.read(tmp_path / "b", 0, out).result()
    assert torch.equal(out.view(torch.int16), src.view(torch.int16))


@pytest.mark.parametrize("name", dtypes.ZARR_NAMES)
def test_every_dtype_round_trips(fio, tmp_path, name):
    """Each dtype an array can hold, at a size that is not whole pages or whole blocks."""
    dt = dtypes.dtype(name).torch
    n = (200 << 10) // dtypes.itemsize(name) + 3
    src = _pattern(n * dtypes.itemsize(name), 9).view(dt)
    pool = BufferPool(1 << 20)
    buf = pool.acquire(src.numel() * src.element_size())
    buf.bytes.copy_(src.view(torch.uint8))
    fio.write(tmp_path / "d", 4096, buf, sync=True).result()
    back = pool.acquire(buf.nbytes)
    fio.read(tmp_path / "d", 4096, back).result()
    assert torch.equal(back.bytes, buf.bytes)


def test_future_is_awaitable_from_asyncio(fio, tmp_path):
    src = _pattern(300_000)
    out = torch.empty_like(src)

    async def go():
        await fio.write(tmp_path / "a", 0, src)
        n = await fio.read(tmp_path / "a", 0, out)
        return n

    assert asyncio.run(go()) == 300_000
    assert torch.equal(out, src)


def test_gather_sums_and_propagates_errors(fio, tmp_path):
    a = fio.write(tmp_path / "g", 0, _pattern(5000))
    b = fio.write(tmp_path / "g", 5000, _pattern(100))
    assert IOFuture.gather([a, b]).result() == 5100
    bad = fio.read(tmp_path / "missing", 0, bytearray(10))
    with pytest.raises(FileIOError):
        IOFuture.gather([fio.read(tmp_path / "g", 0, bytearray(10)), bad]).result()


def test_short_transfers_are_continued_until_every_byte_moved(tmp_path, monkeypatch):
    """The kernel may move fewer bytes than asked (2 GiB cap, signals, pipes): loop."""
    calls = {"read": 0, "write": 0}
    real_preadv, real_pwritev = os.preadv, os.pwritev

    def short_preadv(fd, bufs, off, *a):
        calls["read"] += 1
        return real_preadv(fd, [memoryview(bufs[0])[:1000]], off, *a)

    def short_pwritev(fd, bufs, off, *a):
        calls["write"] += 1
        return real_pwritev(fd, [memoryview(bufs[0])[:777]], off, *a)

    monkeypatch.setattr(file_io_mod.os, "preadv", short_preadv)
    monkeypatch.setattr(file_io_mod.os, "pwritev", short_pwritev)
    with AsyncFileIO(threads=2, queue_depth=2, block_size=64 << 10, direct=False) as io:
        src = _pattern(100_000, 2)
        io.write(tmp_path / "s", 0, src).result()
        out = torch.empty_like(src)
        io.read(tmp_path / "s", 0, out).result()
    assert torch.equal(out, src)
    assert calls["write"] >= 100_000 // 777 and calls["read"] >= 100


def test_missing_file_names_path_and_errno(fio, tmp_path):
    with pytest.raises(FileIOError) as info:
        fio.read(tmp_path / "nope", 0, bytearray(4096)).result()
    e = info.value
    assert e.errno == errno.ENOENT and e.path == str(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(e)


def test_truncated_file_is_an_error_naming_the_file(fio, tmp_path):
    path = tmp_path / "t"
    path.write_bytes(b"x" * 5000)
    with pytest.raises(TruncatedFileError) as info:
        fio.read(path, 4096, bytearray(8192)).result()
    e = info.value
    assert e.path == str(path) and "ends at byte 5000" in str(e)
    assert e.offset is not None and e.length is not None


def test_full_disk_write_reports_enospc(fio, tmp_path):
    # /dev/full answers every write with ENOSPC: a disk with no space left.
    with pytest.raises(FileIOError) as info:
        fio.write("/dev/full", 0, _pattern(8192)).result()
    assert info.value.errno == errno.ENOSPC and info.value.path == "/dev/full"
    assert "No space left" in str(info.value)


def test_full_disk_preallocation_reports_enospc(fio, tmp_path):
    huge = 1 << 60  # more than any disk here has
    with pytest.raises(FileIOError) as info:
        fio.preallocate(tmp_path / "big", huge)
    assert info.value.errno in (errno.ENOSPC, errno.EFBIG)
    assert str(tmp_path / "big") in str(info.value)


def test_preallocated_file_reads_zeros(fio, tmp_path):
    fio.preallocate(tmp_path / "z", 1 << 20)
    assert os.path.getsize(tmp_path / "z") == 1 << 20
    out = torch.full((1 << 20,), 7, dtype=torch.uint8)
    fio.read(tmp_path / "z", 0, out).result()
    assert int(out.max()) == 0


@pytest.mark.multiprocess
def test_read_only_directory_gives_clear_error(tmp_path):
    """Run as an unprivileged user (root ignores directory permissions)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "existing").write_bytes(b"y" * 4096)
    os.chmod(ro, 0o555)
    code = textwrap.dedent(f"""
        import errno, sys
        from offload_engine.io import AsyncFileIO, FileIOError
        io = AsyncFileIO(threads=1, queue_depth=1)
        try:
            io.write({str(ro / 'new')!r}, 0, bytearray(4096)).result()
        except FileIOError as e:
            print("ERR", e.errno, e)
        buf = bytearray(4096)
        print("READ", io.read({str(ro / 'existing')!r}, 0, buf).result())
        io.close()
    """)
    cmd = [sys.executable, "-c", code]
    if os.geteuid() == 0:
        # root ignores permission bits; drop the override capabilities for the child
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: cannot make a directory read-only")
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] + cmd
    out = subprocess.run(cmd, capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert f"ERR {errno.EACCES}" in out.stdout and str(ro / "new") in out.stdout
    assert "READ 4096" in out.stdout  # readers are unaffected


def test_o_direct_refusal_falls_back_to_buffered_and_logs(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def no_direct_open(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(file_io_mod.os, "open", no_direct_open)
    pool = BufferPool(1 << 20)
    buf = pool.acquire(64 << 10)
    buf.bytes.copy_(_pattern(64 << 10, 3))
    with caplog.at_level(logging.WARNING), AsyncFileIO(threads=2, queue_depth=2) as io:
        io.write(tmp_path / "n", 0, buf).result()
        back = pool.acquire(64 << 10)
        io.read(tmp_path / "n", 0, back).result()
        assert io.uses_direct(tmp_path / "n") is False
        assert io.stats.direct_pieces == 0
    assert torch.equal(back.bytes, buf.bytes)
    assert sum("O_DIRECT refused" in r.message for r in caplog.records) == 1


def test_probe_direct_leaves_nothing_and_raises_only_when_strict(tmp_path, monkeypatch):
    assert isinstance(probe_direct(tmp_path), bool)
    assert os.listdir(tmp_path) == []  # the probe file is gone
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError):
        probe_direct(missing)
    assert probe_direct(missing, strict=False) is False
    real_open = os.open

    def no_direct_open(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct_open)
    assert probe_direct(tmp_path) is False  # a refusal is a no, strict or not


def test_descriptors_are_cached_and_bounded(tmp_path):
    before = len(os.listdir("/proc/self/fd"))
    with AsyncFileIO(threads=2, queue_depth=2, max_open_files=4) as io:
        for round_ in range(3):
            for i in range(10):
                io.write(tmp_path / f"f{i}", 0, _pattern(100, i)).result()
        assert io.open_files <= 4
    assert len(os.listdir("/proc/self/fd")) == before


def test_bad_block_size_is_rejected():
    with pytest.raises(ValueError, match="multiple of 4096"):
        AsyncFileIO(block_size=1000)


def test_buffered_write_back_loop_does_not_grow_the_page_cache(tmp_path):
    """A buffered write is written out and dropped (sync_file_range, DONTNEED) before it
    completes, so writing the whole state step after step leaves none of it cached
    (mincore per file: other processes cannot disturb the figure); reads drop theirs too."""
    from offload_engine.io.device_profile import MEMORY_FS, mount_of
    from offload_engine.io.page_cache import resident_bytes

    if mount_of(str(tmp_path))[1] in MEMORY_FS:
        pytest.skip("tmpfs: the page cache is the file's only copy")
    block = 256 << 10
    with _io("buffered", "buffered", threads=4, queue_depth=4, block_size=block) as io:
        pool = BufferPool(4 << 20)
        buf = pool.acquire(4 << 20)
        buf.bytes.copy_(_pattern(4 << 20, 3))
        files = [tmp_path / f"chunk{i}" for i in range(4)]
        worst = 0
        for _step in range(3):
            for f in files:  # 16 MiB per step, one request per file
                io.write(f, 0, buf).result()
                worst = max(worst, resident_bytes([str(x) for x in files if x.exists()]))
            for f in files:
                io.read(f, 0, buf).result()
                worst = max(worst, resident_bytes([str(x) for x in files]))
        assert io.stats.buffered_pieces > 0 and io.stats.direct_pieces == 0
    # written out and dropped piece by piece: at most a few pages in transit, never a file
    assert worst <= 64 << 10, f"{worst} bytes of the state stayed in the page cache"


def test_buffered_read_caches_nothing_outside_its_range_when_the_kernel_ignores_willneed(
        tmp_path, monkeypatch):
    """WILLNEED is a hint the kernel may drop (under memory pressure); a piece whose pages are
    then missing must not make the kernel read ahead past it (up to read_ahead_kb, 8 MiB on
    some disks) into bytes no piece will drop, or a read of one range of a file leaves the
    rest of the file cached."""
    from offload_engine.io import syscalls
    from offload_engine.io.device_profile import MEMORY_FS, mount_of
    from offload_engine.io.page_cache import evict, resident_bytes

    if mount_of(str(tmp_path))[1] in MEMORY_FS:
        pytest.skip("tmpfs: the page cache is the file's only copy")
    path = tmp_path / "state"
    src = _pattern(8 << 20, 5)
    with _io("direct", "direct") as io:
        io.write(path, 0, src, sync=True).result()
    evict([str(path)])
    assert resident_bytes([str(path)]) == 0

    announce = syscalls.fadvise
    monkeypatch.setattr(syscalls, "fadvise", lambda fd, offset, length, advice: (
        None if advice == os.POSIX_FADV_WILLNEED else announce(fd, offset, length, advice)))
    # one piece in flight, so each piece's read is a miss that follows the previous one
    with _io("buffered", "buffered", threads=1, queue_depth=1, block_size=256 << 10) as io:
        out = torch.empty(1 << 20, dtype=torch.uint8)
        io.read(path, 2 << 20, out).result()  # [2 MiB, 3 MiB) of an 8 MiB file
        assert torch.equal(out, src[2 << 20:3 << 20])
        assert io.stats.buffered_pieces == 4
    cached = resident_bytes([str(path)])
    assert cached == 0, f"{cached} bytes of {path} stayed cached after a buffered read of 1 MiB"


def _record_calls(monkeypatch, syscalls):
    """Every preadv / pwritev / fdatasync the workers make, in order: (op, file name, offset)."""
    calls = []
    for name in ("preadv", "pwritev"):
        real = getattr(syscalls, name)

        def wrapped(fd, buffers, offset, path, real=real, name=name):
            calls.append((name, os.path.basename(path), offset))
            return real(fd, buffers, offset, path)
        monkeypatch.setattr(syscalls, name, wrapped)
    real_sync = syscalls.fdatasync
    monkeypatch.setattr(syscalls, "fdatasync", lambda fd, path: (
        calls.append(("fdatasync", os.path.basename(path), None)), real_sync(fd, path))[1])
    return calls


def _hold_file_named_gate(monkeypatch, syscalls, name: str):
    """Make ``syscalls.<name>`` on a file named "gate" wait for the returned ``gate`` event
    (``started`` is set when it begins): with one worker, everything queued meanwhile waits,
    so the order the queue hands pieces out is what the recorded calls show."""
    import threading

    gate, started = threading.Event(), threading.Event()
    real = getattr(syscalls, name)

    def held(fd, buffers, offset, path):
        if os.path.basename(path) == "gate":
            started.set()
            assert gate.wait(10)
        return real(fd, buffers, offset, path)
    monkeypatch.setattr(syscalls, name, held)
    return gate, started


@pytest.mark.parametrize("streams", [1, 2, 3])
def test_streams_take_one_piece_from_each_of_the_oldest_requests_in_turn(tmp_path, monkeypatch,
                                                                         streams):
    """With ``streams`` S, the pieces of the S oldest requests go out in turn, one from each
    (several regions of the disk busy at once); a finished request's place goes to the next
    one. S = 1 is plain request order. Bytes are the same either way."""
    from offload_engine.io import syscalls

    piece = 64 << 10
    names = ["gate", "a", "b", "c"]
    src = {n: _pattern(3 * piece, i) for i, n in enumerate(names)}
    with _io() as io:
        for n in names:
            io.write(tmp_path / n, 0, src[n], sync=True).result()
    calls = _record_calls(monkeypatch, syscalls)
    gate, started = _hold_file_named_gate(monkeypatch, syscalls, "preadv")
    with _io("direct", "direct", streams, threads=1, queue_depth=1, block_size=piece) as io:
        out = {n: torch.empty(3 * piece, dtype=torch.uint8) for n in names}
        first = io.read(tmp_path / "gate", 0, out["gate"], length=piece)
        assert started.wait(10)  # the only worker is busy: a, b, c all wait in the queue
        futures = [io.read(tmp_path / n, 0, out[n]) for n in "abc"]
        gate.set()
        first.result()
        for f in futures:
            f.result()
    for n in "abc":
        assert torch.equal(out[n], src[n])
    order = [(name, off // piece) for op, name, off in calls if op == "preadv" and name != "gate"]
    expected = {1: ["a0", "a1", "a2", "b0", "b1", "b2", "c0", "c1", "c2"],
                2: ["a0", "b0", "a1", "b1", "a2", "b2", "c0", "c1", "c2"],
                3: ["a0", "b0", "c0", "a1", "b1", "c1", "a2", "b2", "c2"]}[streams]
    assert [f"{n}{k}" for n, k in order] == expected


def test_a_sync_starts_after_the_pieces_queued_before_it_and_before_those_after(tmp_path,
                                                                                monkeypatch):
    """Streams never let a sync jump ahead of writes queued before it, nor writes queued
    after it jump ahead of the sync."""
    from offload_engine.io import syscalls

    piece = 64 << 10
    calls = _record_calls(monkeypatch, syscalls)
    gate, started = _hold_file_named_gate(monkeypatch, syscalls, "pwritev")
    src = _pattern(2 * piece, 9)
    with _io("direct", "direct", 4, threads=1, queue_depth=1, block_size=piece) as io:
        first = io.write(tmp_path / "gate", 0, src, length=piece)
        assert started.wait(10)
        futures = [io.write(tmp_path / "a", 0, src), io.write(tmp_path / "b", 0, src),
                   io.sync(tmp_path / "a"), io.write(tmp_path / "c", 0, src),
                   io.write(tmp_path / "d", 0, src)]
        gate.set()
        first.result()
        for f in futures:
            f.result()
    order = [f"{name}{'' if off is None else off // piece}" for op, name, off in calls
             if name != "gate"]
    assert order == ["a0", "b0", "a1", "b1", "a", "c0", "d0", "c1", "d1"]
