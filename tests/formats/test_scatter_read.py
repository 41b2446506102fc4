"""The DeepSpeed reader's coalescing reads (formats/deepspeed/scatter_read.py): what a user
of import, consolidate or inspect relies on beyond the bytes being right."""

import os

import numpy as np
import pytest

from offload_engine.formats.deepspeed.scatter_read import ScatterReader, Want


def _cached_file(path, nbytes: int) -> bytes:
    data = np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    with open(path, "rb") as f:  # in the page cache now, as a checkpoint just written is
        f.read()
    return data


@pytest.mark.parametrize("drop_behind", [True, False])
def test_a_checkpoint_read_once_does_not_stay_in_the_page_cache(tmp_path, drop_behind):
    """A DeepSpeed checkpoint larger than RAM read through the page cache makes the kernel
    reclaim as it reads (import of 32 GB on 23 GiB: 39.9 s of system time); each run is
    dropped once read, so the cache holds at most the pieces in flight."""
    from offload_engine.io.device_profile import MEMORY_FS, mount_of
    from offload_engine.io.page_cache import resident_bytes

    if mount_of(str(tmp_path))[1] in MEMORY_FS:
        pytest.skip("tmpfs: the page cache is the file's only copy")
    size = 48 << 20
    path = str(tmp_path / "mp_rank_00.pt")
    data = _cached_file(path, size)
    assert resident_bytes([path]) >= size // 2  # else the test would prove nothing
    # ranges with holes (tail padding) and a hole too large to bridge, out of order
    spans = [(o, o + (1 << 20) - 512) for o in range(0, size, 1 << 20)][::-1]
    outs = [bytearray(hi - lo) for lo, hi in spans]
    reader = ScatterReader([path], threads=4, max_piece=4 << 20, drop_behind=drop_behind)
    try:
        reader.read([Want(0, lo, memoryview(out)) for (lo, _), out in zip(spans, outs)])
    finally:
        reader.close()
    assert all(bytes(out) == data[lo:hi] for (lo, hi), out in zip(spans, outs))
    left = resident_bytes([path])
    if drop_behind:  # but a large folio the run's last page shares with bytes not read
        assert left <= 4 << 20, f"{left} bytes of the checkpoint stayed in the page cache"
    else:
        assert left >= size // 2
