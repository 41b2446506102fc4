"""layout/: flat zarr v3 arrays whose chunk files the engine reads and writes through io/."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from offload_engine.io import AsyncFileIO, BufferPool, FileIOError, TruncatedFileError
from offload_engine.io import aligned_host_buffer
from offload_engine.layout import (ChunkSizeError, FlatArray, ForeignArrayError, MetadataError,
                                   NodeNotFoundError, TruncatedChunkError, create_group,
                                   list_arrays, list_children, list_groups, read_group,
                                   write_group_attributes)
from offload_engine.dtypes import ZARR_NAMES, dtype, zarr_dtype

GiB = 1 << 30
PAGE = 4096

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.uint16,
          torch.uint32, torch.uint64]


@pytest.fixture
def io():
    with AsyncFileIO(threads=2, queue_depth=4) as aio:
        yield aio


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def random_tensor(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bits of ``dtype`` (NaNs included for floats: comparisons are bytewise)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).bool()
    return torch.randint(0, 256, (n * itemsize(dtype),), generator=g,
                         dtype=torch.uint8).view(dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(raw(a), raw(b))


# -- round trips ---------------------------------------------------------------------------------
def sizes_for(dtype) -> list[int]:
    ce = PAGE // itemsize(dtype)
    return [0, 1, 4095 // itemsize(dtype), ce + 1, 10 * ce + ce // 2]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype_and_size(tmp_path, io, dtype):
    ce = PAGE // itemsize(dtype)
    for n in sizes_for(dtype):
        path = tmp_path / f"a{n}"
        arr = FlatArray.create(path, n, dtype, io=io, chunk_bytes=PAGE)
        assert (arr.numel, arr.dtype, arr.itemsize) == (n, dtype, itemsize(dtype))
        assert arr.chunk_bytes == PAGE and arr.chunk_elems == ce
        assert arr.nchunks == -(-n // ce)
        data = random_tensor(n, dtype, seed=n)
        arr.write(0, data)
        back = FlatArray.open(path, io=io).read()
        assert same_bits(back, data), (dtype, n)
        for i in range(arr.nchunks):  # every chunk file full size, the edge one included
            assert os.path.getsize(arr.chunk_path(i)) == PAGE
        # sub-ranges that cross chunk boundaries, into a tensor with room to spare
        for start, stop in [(ce - 3, ce + 2), (ce - 1, 3 * ce + 1), (1, n - 1), (n - 1, n)]:
            if 0 <= start <= stop <= n:
                out = torch.empty(stop - start + 5, dtype=dtype)
                got = arr.read_into(start, stop, out).result()
                assert got == (stop - start) * itemsize(dtype)
                assert same_bits(out[:stop - start], data[start:stop])


def test_sub_range_writes_across_chunks_and_buffers(tmp_path, io):
    arr = FlatArray.create(tmp_path / "a", 10_000, torch.float32, io=io, chunk_bytes=8192)
    ce = arr.chunk_elems
    assert ce == 2048 and arr.nchunks == 5
    expect = torch.zeros(10_000)
    piece = torch.arange(3000, dtype=torch.float32) + 1
    arr.write_from(ce - 100, ce - 100 + 3000, piece).result()
    expect[ce - 100:ce - 100 + 3000] = piece
    # into a pooled buffer, a bytearray and a numpy array
    with BufferPool(1 << 20, pin=False) as pool:
        buf = pool.acquire(6000 * 4)
        arr.read_into(1000, 7000, buf).result()
        assert torch.equal(buf.view(torch.float32, 6000), expect[1000:7000])
        buf.release()
    ba = bytearray(4 * 5000)
    arr.read_into(0, 5000, ba).result()
    assert torch.equal(torch.frombuffer(ba, dtype=torch.float32), expect[:5000])
    np_out = torch.empty(10_000).numpy()
    arr.read_into(0, 10_000, np_out).result()
    assert torch.equal(torch.from_numpy(np_out), expect)
    # a write from a bytes object (read-only buffer)
    arr.write_from(9_990, 10_000, torch.full((10,), 7.0).numpy().tobytes()).result()
    expect[9_990:] = 7.0
    assert torch.equal(arr.read(), expect)
    assert torch.equal(arr.read(9_000, 9_995), expect[9_000:9_995])


def test_missing_chunks_read_as_fill_without_io(tmp_path, io):
    arr = FlatArray.create(tmp_path / "a", 5 * 1024, torch.float32, io=io, chunk_bytes=PAGE)
    arr.write(2 * 1024 + 10, torch.ones(5))
    assert sorted(os.listdir(tmp_path / "a" / "c")) == ["2"]
    assert os.path.getsize(arr.chunk_path(2)) == PAGE  # partial write: chunk preallocated
    out = torch.full((5 * 1024,), 9.0)
    io.reset_stats()
    arr.read_into(0, 5 * 1024, out).result()
    assert io.stats.reads == 1  # only chunk 2 was read
    expect = torch.zeros(5 * 1024)
    expect[2 * 1024 + 10:2 * 1024 + 15] = 1
    assert torch.equal(out, expect)
    assert arr.fill_value == 0.0


def test_concurrent_writes_into_new_chunks(tmp_path, io):
    from concurrent.futures import ThreadPoolExecutor

    arr = FlatArray.create(tmp_path / "a", 4096, torch.int32, io=io, chunk_bytes=PAGE)
    data = torch.arange(4096, dtype=torch.int32)
    pieces = [(i, min(i + 100, 4096)) for i in range(0, 4096, 100)]
    with ThreadPoolExecutor(4) as pool:
        futures = list(pool.map(lambda r: arr.write_from(r[0], r[1], data[r[0]:r[1]]), pieces))
    for f in futures:
        f.result()
    assert torch.equal(arr.read(), data)


def test_preallocate_creates_every_chunk(tmp_path, io):
    arr = FlatArray.create(tmp_path / "a", 3 * 1024 + 1, torch.float32, io=io,
                           chunk_bytes=PAGE, preallocate=True)
    assert sorted(os.listdir(tmp_path / "a" / "c")) == ["0", "1", "2", "3"]
    assert all(os.path.getsize(arr.chunk_path(i)) == PAGE for i in range(4))
    assert torch.equal(arr.read(), torch.zeros(3 * 1024 + 1))


def test_write_sync_and_sync_all(tmp_path, io):
    arr = FlatArray.create(tmp_path / "a", 4096, torch.int32, io=io, chunk_bytes=PAGE)
    data = torch.arange(4096, dtype=torch.int32)
    assert arr.write_from(0, 4096, data, sync=True).result() == 4096 * 4
    assert arr.sync().result() == 0
    assert torch.equal(arr.read(), data)


def test_default_chunk_is_64MiB_but_capped_at_the_array(tmp_path, io):
    big = FlatArray.create(tmp_path / "big", 20 << 20, torch.float32, io=io)
    assert big.chunk_bytes == 64 << 20 and big.chunk_elems == 16 << 20 and big.nchunks == 2
    small = FlatArray.create(tmp_path / "small", 10, torch.float32, io=io)
    assert small.chunk_bytes == PAGE and small.nchunks == 1
    empty = FlatArray.create(tmp_path / "empty", 0, torch.bfloat16, io=io)
    assert empty.nchunks == 0 and empty.read().numel() == 0
    assert empty.read_into(0, 0, torch.empty(0, dtype=torch.bfloat16)).result() == 0


# -- metadata --------------------------------------------------------------------------------------
def test_zarr_json_fields(tmp_path, io):
    FlatArray.create(tmp_path / "a", 10_000, torch.bfloat16, io=io, chunk_bytes=8192,
                     attributes={"kind": "exp_avg", "rank": 3}, dimension_name="param_elem")
    doc = json.loads((tmp_path / "a" / "zarr.json").read_text())
    assert doc == {
        "zarr_format": 3, "node_type": "array", "shape": [10000], "data_type": "bfloat16",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4096]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0.0,
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        "attributes": {"kind": "exp_avg", "rank": 3},
        "dimension_names": ["param_elem"], "storage_transformers": [],
    }
    assert FlatArray.open(tmp_path / "a", io=io).attributes == {"kind": "exp_avg", "rank": 3}


def test_update_attributes_is_atomic_and_keeps_fields(tmp_path, io):
    arr = FlatArray.create(tmp_path / "a", 100, torch.float32, io=io, attributes={"a": 1})
    before = json.loads((tmp_path / "a" / "zarr.json").read_text())
    arr.update_attributes({"b": [1, 2], "a": 5})
    after = json.loads((tmp_path / "a" / "zarr.json").read_text())
    assert after["attributes"] == {"a": 5, "b": [1, 2]}
    assert {k: v for k, v in after.items() if k != "attributes"} == \
        {k: v for k, v in before.items() if k != "attributes"}
    assert sorted(os.listdir(tmp_path / "a")) == ["c", "zarr.json"]  # no temp file left
    assert arr.attributes == {"a": 5, "b": [1, 2]}
    with pytest.raises(ValueError, match="read-only"):
        FlatArray.open(tmp_path / "a", io=io).update_attributes({"c": 1})
    with pytest.raises(ValueError, match="JSON"):
        arr.update_attributes({"bad": object()})


def test_dtype_names_map_both_ways():
    assert dtype(torch.bfloat16).name == "bfloat16"
    assert dtype(torch.float32).name == "float32"
    assert zarr_dtype("int64").torch is torch.int64
    for name in ZARR_NAMES:
        assert zarr_dtype(dtype(zarr_dtype(name).torch).name).name == name
    with pytest.raises(ValueError, match="complex64"):
        zarr_dtype(dtype(torch.complex64).name)
    with pytest.raises(ValueError):
        zarr_dtype("complex64")
    with pytest.raises(ValueError, match="complex64"):
        FlatArray.create("/nonexistent/x", 4, torch.complex64, io=None)


# -- validation ------------------------------------------------------------------------------------
def test_argument_validation_names_the_array(tmp_path, io):
    arr = FlatArray.create(tmp_path / "a", 100, torch.float32, io=io)
    p = str(tmp_path / "a")
    bad = [
        (lambda: arr.read_into(0, 101, torch.empty(101)), "within"),
        (lambda: arr.read_into(50, 40, torch.empty(10)), "within"),
        (lambda: arr.read_into(-1, 10, torch.empty(11)), "non-negative"),
        (lambda: arr.read_into(0, 10, torch.empty(10, dtype=torch.float16)), "dtype"),
        (lambda: arr.read_into(0, 10, torch.empty(9)), "9 elements"),
        (lambda: arr.read_into(0, 10, torch.empty(20)[::2]), "contiguous"),
        (lambda: arr.read_into(0, 10, bytearray(39)), "39 bytes"),
        (lambda: arr.read_into(0, 10, b"\0" * 40), "read-only"),
        (lambda: arr.read_into(0, 10, 12345), "buffer"),
        (lambda: arr.write_from(0, 10, torch.zeros(10, dtype=torch.int32)), "dtype"),
        (lambda: arr.write_from(95, 105, torch.zeros(10)), "within"),
        (lambda: arr.write_from(0, 10, torch.zeros(5)), "5 elements"),
        (lambda: arr.write(0, torch.zeros(3, dtype=torch.float64)), "dtype"),
    ]
    for call, what in bad:
        with pytest.raises(ValueError, match=what) as info:
            call()
        assert p in str(info.value)
    with BufferPool(1 << 16, pin=False) as pool:
        buf = pool.acquire(39)
        with pytest.raises(ValueError, match="39 bytes"):
            arr.read_into(0, 10, buf)
        buf.release()
    reader = FlatArray.open(p, io=io)
    with pytest.raises(ValueError, match="read-only"):
        reader.write(0, torch.zeros(1))
    with pytest.raises(ValueError, match="mode"):
        FlatArray.open(p, io=io, mode="w")


def test_create_validation(tmp_path, io):
    with pytest.raises(ValueError, match="multiple of 4096"):
        FlatArray.create(tmp_path / "a", 100, torch.float32, io=io, chunk_bytes=4000)
    with pytest.raises(ValueError, match="multiple of 4096"):
        FlatArray.create(tmp_path / "b", 100, torch.float32, io=io, chunk_bytes=0)
    with pytest.raises(ValueError, match="numel"):
        FlatArray.create(tmp_path / "c", -1, torch.float32, io=io)
    with pytest.raises(ValueError, match="complex64"):
        FlatArray.create(tmp_path / "d", 1, torch.complex64, io=io)
    with pytest.raises(ValueError, match="JSON"):
        FlatArray.create(tmp_path / "e", 1, torch.float32, io=io, attributes={"x": {1, 2}})
    with pytest.raises(ValueError, match="JSON"):
        FlatArray.create(tmp_path / "e", 1, torch.float32, io=io,
                         attributes={"x": float("nan")})
    assert not os.path.exists(tmp_path / "e")  # refused before touching the disk


def test_create_refuses_existing_unless_overwrite(tmp_path, io):
    old = FlatArray.create(tmp_path / "a", 2048, torch.float32, io=io, chunk_bytes=PAGE)
    old.write(0, torch.ones(2048))
    with pytest.raises(FileExistsError, match="overwrite"):
        FlatArray.create(tmp_path / "a", 10, torch.float32, io=io)
    new = FlatArray.create(tmp_path / "a", 2048, torch.float32, io=io, chunk_bytes=PAGE,
                           overwrite=True)
    assert torch.equal(new.read(), torch.zeros(2048))  # stale chunks gone
    new.write(0, torch.full((2,), 3.0))
    assert torch.equal(FlatArray.open(tmp_path / "a", io=io).read(0, 3),
                       torch.tensor([3.0, 3.0, 0.0]))
    create_group(tmp_path / "g")
    with pytest.raises(FileExistsError):
        FlatArray.create(tmp_path / "g", 10, torch.float32, io=io, overwrite=True)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        FlatArray.create(tmp_path / "junk", 10, torch.float32, io=io)


# -- damaged stores --------------------------------------------------------------------------------
def test_truncated_chunk_is_an_error_naming_the_file(tmp_path, io):
    arr = FlatArray.create(tmp_path / "a", 3 * 1024, torch.float32, io=io, chunk_bytes=PAGE)
    arr.write(0, torch.ones(3 * 1024))
    chunk = arr.chunk_path(1)
    os.truncate(chunk, 1000)
    reader = FlatArray.open(tmp_path / "a", io=io)
    with pytest.raises(TruncatedChunkError, match="truncated chunk") as info:
        reader.read()
    assert chunk in str(info.value)
    assert isinstance(info.value, TruncatedFileError) and isinstance(info.value, FileIOError)
    with pytest.raises(TruncatedChunkError, match="truncated chunk"):
        reader.read_into(1024, 1030, torch.empty(6))  # even a range inside the short file
    assert torch.equal(reader.read(0, 1024), torch.ones(1024))  # other chunks still read
    with pytest.raises(TruncatedChunkError):
        arr.write(1024, torch.ones(2))
    with open(arr.chunk_path(2), "ab") as f:
        f.write(b"x")
    with pytest.raises(ChunkSizeError, match=arr.chunk_path(2)):
        reader.read(2048, 2050)


def test_missing_array_is_a_clear_error(tmp_path, io):
    with pytest.raises(NodeNotFoundError, match="does not exist") as info:
        FlatArray.open(tmp_path / "nope", io=io)
    assert str(tmp_path / "nope") in str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    (tmp_path / "empty").mkdir()
    with pytest.raises(NodeNotFoundError, match="has no zarr.json"):
        FlatArray.open(tmp_path / "empty", io=io)


@pytest.mark.parametrize("text, what", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"node_type": "array"}', "zarr_format"),
    ('{"zarr_format": 2, "node_type": "array"}', "zarr_format 2"),
    ('{"zarr_format": 3, "node_type": "thing"}', "node_type"),
    ('{"zarr_format": 3, "node_type": "group", "attributes": {}}', "not an array"),
    ('{"zarr_format": 3, "node_type": "array", "shape": [4]}', "missing the required key"),
])
def test_corrupt_zarr_json_names_the_file(tmp_path, io, text, what):
    arr = FlatArray.create(tmp_path / "a", 4, torch.float32, io=io)
    (tmp_path / "a" / "zarr.json").write_text(text)
    with pytest.raises(MetadataError, match=what) as info:
        FlatArray.open(arr.path, io=io)
    assert os.path.join(arr.path, "zarr.json") in str(info.value)


@pytest.mark.parametrize("change, error, what", [
    ({"shape": [2, 2]}, ForeignArrayError, "2-dimensional"),
    ({"data_type": "complex64"}, ForeignArrayError, "complex64"),
    ({"storage_transformers": [{"name": "x"}]}, ForeignArrayError, "storage transformers"),
    ({"chunk_grid": {"name": "rectilinear", "configuration": {}}}, ForeignArrayError,
     "rectilinear"),
    ({"chunk_key_encoding": {"name": "odd"}}, ForeignArrayError, "odd"),
    ({"fill_value": "zero"}, MetadataError, "fill_value"),
    ({"fill_value": 1.5, "data_type": "int32"}, MetadataError, "fill_value"),
    ({"codecs": []}, MetadataError, "codecs"),
    ({"codecs": [{"name": "bytes"}]}, MetadataError, "endian"),
    ({"shape": [-1]}, MetadataError, "shape"),
    ({"chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [0]}}},
     MetadataError, "chunk_shape"),
    ({"new_feature": {"name": "x"}}, ForeignArrayError, "new_feature"),
])
def test_metadata_we_cannot_serve_is_refused(tmp_path, io, change, error, what):
    arr = FlatArray.create(tmp_path / "a", 4, torch.float32, io=io)
    doc = json.loads((tmp_path / "a" / "zarr.json").read_text())
    doc.update(change)
    (tmp_path / "a" / "zarr.json").write_text(json.dumps(doc))
    with pytest.raises(error, match=what) as info:
        FlatArray.open(arr.path, io=io)
    assert arr.path in str(info.value)


def test_optional_extension_fields_are_ignored(tmp_path, io):
    arr = FlatArray.create(tmp_path / "a", 4, torch.float32, io=io)
    doc = json.loads((tmp_path / "a" / "zarr.json").read_text())
    doc["hint"] = {"must_understand": False, "x": 1}
    (tmp_path / "a" / "zarr.json").write_text(json.dumps(doc))
    assert FlatArray.open(arr.path, io=io).direct


# -- groups ----------------------------------------------------------------------------------------
def test_groups(tmp_path, io):
    g = tmp_path / "store"
    create_group(g, {"manifest": {"a": 1}})
    assert json.loads((g / "zarr.json").read_text()) == {
        "zarr_format": 3, "node_type": "group", "attributes": {"manifest": {"a": 1}}}
    assert read_group(g) == {"manifest": {"a": 1}}
    write_group_attributes(g, {"generation": 2})
    assert read_group(g) == {"generation": 2}
    assert sorted(os.listdir(g)) == ["zarr.json"]  # no temp file left
    FlatArray.create(g / "m", 10, torch.float32, io=io)
    FlatArray.create(g / "b", 10, torch.bfloat16, io=io)
    create_group(g / "sub")
    (g / "not_a_node").mkdir()
    assert list_arrays(g) == ["b", "m"]
    assert list_groups(g) == ["sub"]
    assert list_children(g) == {"b": "array", "m": "array", "sub": "group"}
    with pytest.raises(FileExistsError):
        create_group(g)
    create_group(g, exist_ok=True)
    assert read_group(g) == {"generation": 2}
    create_group(g, {"x": 1}, exist_ok=True)
    assert read_group(g) == {"x": 1}
    with pytest.raises(FileExistsError, match="array"):
        create_group(g / "m", exist_ok=True)
    with pytest.raises(MetadataError, match="not a group"):
        read_group(g / "m")
    with pytest.raises(NodeNotFoundError):
        read_group(tmp_path / "missing")
    with pytest.raises(ValueError, match="JSON"):
        write_group_attributes(g, {"x": object()})
    with pytest.raises(ValueError, match="JSON"):
        create_group(tmp_path / "g2", {"x": object()})
    assert not os.path.exists(tmp_path / "g2")
    (g / "sub" / "zarr.json").write_text("{")
    with pytest.raises(MetadataError, match=str(g / "sub" / "zarr.json")):
        read_group(g / "sub")


# -- one request over 2 GiB ------------------------------------------------------------------------
def _block_sums(t: torch.Tensor, block: int = 1 << 24) -> list[int]:
    """Position-sensitive checksum: one int64 sum per block of int16 values."""
    v = t.view(torch.int16)
    return [int(v[i:i + block].sum(dtype=torch.int64)) for i in range(0, v.numel(), block)]


@pytest.mark.slow
def test_single_request_over_2GiB_round_trips(tmp_path):
    numel = (2 * GiB + PAGE) // 2  # bfloat16 elements: 2 GiB + 4096 bytes in one chunk file
    region, raw_buf = aligned_host_buffer(numel * 2)  # page-aligned: O_DIRECT where allowed
    buf = raw_buf[:numel * 2].view(torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    step = 1 << 26  # fill in 128 MiB blocks: peak memory stays near the 2 GiB buffer
    for i in range(0, numel, step):
        n = min(step, numel - i)
        buf[i:i + n].view(torch.int16).copy_(
            torch.randint(-32768, 32768, (n,), generator=g, dtype=torch.int16))
    sums = _block_sums(buf)
    probes = [buf[i::50_000_017].clone() for i in (0, 1, 4093)] + [buf[-2048:].clone()]
    timings = {}
    with AsyncFileIO(threads=2, queue_depth=4, block_size=64 << 20) as io:
        arr = FlatArray.create(tmp_path / "big", numel, torch.bfloat16, io=io,
                               chunk_bytes=4 * GiB)
        assert arr.nchunks == 1 and arr.chunk_bytes == 2 * GiB + PAGE
        t0 = time.perf_counter()
        assert arr.write_from(0, numel, buf).result() == numel * 2
        timings["write_s"] = time.perf_counter() - t0
        assert os.path.getsize(arr.chunk_path(0)) == 2 * GiB + PAGE
        buf.view(torch.int16).fill_(0x5555)  # so a read that moves nothing is caught
        t0 = time.perf_counter()
        assert arr.read_into(0, numel, buf).result() == numel * 2
        timings["read_s"] = time.perf_counter() - t0
        timings["direct_pieces"] = io.stats.direct_pieces
    assert _block_sums(buf) == sums
    for i, p in zip((0, 1, 4093), probes):
        assert same_bits(buf[i::50_000_017], p)
    assert same_bits(buf[-2048:], probes[-1])
    print(f"\n2 GiB + 4 KiB single request: {timings}")
    del buf, raw_buf
    os.remove(arr.chunk_path(0))
