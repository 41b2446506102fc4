"""The staged writer that packs parameters into checkpoint arrays: bytes, checksums, and
few large page-aligned writes whatever the array's chunk size."""

import os

import pytest
import torch

from offload_engine.layout.checksums import SequentialChunkCrc
from helpers.synthetic import file_crc32c
from offload_engine.checkpoint.staged_writer import BLOCK_BYTES, StagedWriter, StagingBlocks
from offload_engine.io import AsyncFileIO
from offload_engine.layout import FlatArray

MiB = 1 << 20


@pytest.mark.parametrize("sizes, chunk_bytes", [
    # 3 MiB + 40 B in 1 MiB chunks: an 8 MiB block spans chunk files
    ([1000, 7, 262144, 1, 523287, 3], 1 * MiB),
    # 9.2 MB in one chunk of the array's page-rounded size (the default 64 MiB is capped
    # to it): not a multiple of the block, which must not shrink the blocks
    ([2_000_000, 5, 300_001, 17], 64 * MiB),
])
def test_packed_tensors_land_in_order_with_their_chunk_checksums_in_few_writes(tmp_path, sizes,
                                                                                chunk_bytes):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=g) for n in sizes]  # all but the first start unaligned
    total = sum(sizes)
    with AsyncFileIO(threads=2, queue_depth=4) as io:
        arr = FlatArray.create(str(tmp_path / "param"), total, torch.float32, io=io,
                               chunk_bytes=chunk_bytes)
        crcs = SequentialChunkCrc(arr.chunk_bytes, total * 4)
        writer = StagedWriter(arr, StagingBlocks(), crcs)
        writer.add(tensors)
        writer.finish()
        wrote = io.reset_stats()
        recorded = crcs.finish()
        assert torch.equal(arr.read(), torch.cat(tensors))
        assert recorded == [file_crc32c(arr.chunk_path(i)) for i in range(arr.nchunks)]
    # one write per block and chunk file it spans, and the last partial page: not one per
    # tensor, nor per 4 KiB; all but that page with O_DIRECT where the file system allows
    blocks = -(-total * 4 // BLOCK_BYTES)
    assert wrote.writes <= blocks + arr.nchunks + 1, wrote
    assert wrote.buffered_pieces == 1 or io.uses_direct(arr.chunk_path(0)) is False, wrote
    assert os.path.getsize(arr.chunk_path(arr.nchunks - 1)) == arr.chunk_bytes
