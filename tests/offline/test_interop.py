"""Interop: zarr-python and tensorstore read what the engine writes, and the engine reads
what they write (or refuses it clearly; never wrong bytes)."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import BytesCodec

import offload_engine.layout as layout
from offload_engine.io import AsyncFileIO
from offload_engine.layout import FlatArray, ForeignArrayError, create_group, read_group

ts = pytest.importorskip("tensorstore")

PAGE = 4096
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.uint16,
          torch.uint32, torch.uint64]


@pytest.fixture
def io():
    with AsyncFileIO(threads=2, queue_depth=4) as aio:
        yield aio


def random_tensor(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).bool()
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8).view(dtype)


def np_bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def t_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def ts_open(path, **kw):
    return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}},
                   **kw).result()


# -- engine writes, others read ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zarr_python_and_tensorstore_read_engine_arrays(tmp_path, io, dtype):
    size = torch.empty((), dtype=dtype).element_size()
    ce = PAGE // size
    n = 4 * ce + 7  # five chunks, the last one an edge chunk
    arr = FlatArray.create(tmp_path / "a", n, dtype, io=io, chunk_bytes=PAGE,
                           attributes={"kind": "test"})
    data = random_tensor(n, dtype, seed=3)
    arr.write_from(0, ce + 5, data[:ce + 5]).result()  # chunks 0 and 1
    arr.write_from(3 * ce, n, data[3 * ce:]).result()  # chunks 3 and 4; chunk 2 stays missing
    expect = data.clone()
    expect[ce + 5:3 * ce] = 0
    assert not os.path.exists(arr.chunk_path(2))

    z = zarr.open_array(tmp_path / "a", mode="r")
    assert z.shape == (n,) and z.attrs["kind"] == "test"
    assert np.array_equal(np_bytes(z[:]), t_bytes(expect))
    assert np.array_equal(np_bytes(z[ce - 3:3 * ce + 2]), t_bytes(expect[ce - 3:3 * ce + 2]))

    t = ts_open(tmp_path / "a")
    assert t.shape == (n,) and t.domain.labels == ("element",)
    assert np.array_equal(np_bytes(t.read().result()), t_bytes(expect))
    assert np.array_equal(np_bytes(t[ce - 3:3 * ce + 2].read().result()),
                          t_bytes(expect[ce - 3:3 * ce + 2]))


def test_bfloat16_values_survive_every_reader(tmp_path, io):
    values = torch.tensor([0.0, -0.0, 1.0, -2.5, 3.140625, float("inf"), float("-inf"),
                           1e-38, 65280.0], dtype=torch.bfloat16)
    arr = FlatArray.create(tmp_path / "a", values.numel(), torch.bfloat16, io=io)
    arr.write(0, values)
    z = zarr.open_array(tmp_path / "a", mode="r")[:]
    assert z.dtype == np.dtype(ml_dtypes.bfloat16)
    assert np.array_equal(z.view(np.int16), values.view(torch.int16).numpy())
    t = ts_open(tmp_path / "a").read().result()
    assert str(t.dtype) == "bfloat16"
    assert np.array_equal(t.view(np.int16), values.view(torch.int16).numpy())
    with open(arr.chunk_path(0), "rb") as f:  # raw layout: little-endian 16-bit words
        assert np.array_equal(np.frombuffer(f.read(18), dtype="<i2"),
                              values.view(torch.int16).numpy())


def test_numpy_alone_reads_an_engine_array(tmp_path, io):
    data = torch.arange(3000, dtype=torch.float32)
    arr = FlatArray.create(tmp_path / "a", 3000, torch.float32, io=io, chunk_bytes=PAGE)
    arr.write(0, data)
    meta = json.loads((tmp_path / "a" / "zarr.json").read_text())
    (chunk,) = meta["chunk_grid"]["configuration"]["chunk_shape"]
    parts = [np.fromfile(tmp_path / "a" / "c" / str(i), dtype="<f4")
             for i in range(-(-meta["shape"][0] // chunk))]
    assert np.array_equal(np.concatenate(parts)[:meta["shape"][0]], data.numpy())


def test_engine_group_is_a_zarr_group(tmp_path, io):
    create_group(tmp_path / "g", {"manifest": {"w": [0, 10]}})
    FlatArray.create(tmp_path / "g" / "w", 10, torch.float32, io=io).write(0, torch.ones(10))
    g = zarr.open_group(tmp_path / "g", mode="r")
    assert dict(g.attrs) == {"manifest": {"w": [0, 10]}}
    assert np.array_equal(g["w"][:], np.ones(10, np.float32))
    zarr.open_group(tmp_path / "z", mode="w", attributes={"a": 1})
    assert read_group(tmp_path / "z") == {"a": 1}


def test_bfloat16_registration_is_idempotent_and_writes_endian(tmp_path):
    layout.register_bfloat16()
    layout.register_bfloat16()
    assert zarr.dtype.data_type_registry.get("bfloat16") is layout.BFloat16
    z = zarr.create_array(tmp_path / "z", shape=(6,), chunks=(4,), dtype="bfloat16",
                          compressors=None, fill_value=float("nan"))
    z[:3] = np.array([1.5, -2, 3], dtype=ml_dtypes.bfloat16)
    meta = json.loads((tmp_path / "z" / "zarr.json").read_text())
    assert meta["data_type"] == "bfloat16" and meta["fill_value"] == "NaN"
    assert meta["codecs"] == [{"name": "bytes", "configuration": {"endian": "little"}}]
    got = ts_open(tmp_path / "z").read().result().view(np.uint16)
    assert list(got) == [0x3FC0, 0xC000, 0x4040, 0x7FC0, 0x7FC0, 0x7FC0]


# -- others write, engine reads ----------------------------------------------------------------------
def test_engine_reads_zarr_python_uncompressed_unaligned_with_fill(tmp_path, io):
    n, chunk = 10_000, 1000  # 4000-byte chunks: not a multiple of 4096
    z = zarr.create_array(tmp_path / "z", shape=(n,), chunks=(chunk,), dtype="float32",
                          compressors=None, fill_value=-7.5)
    data = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    z[0:2500] = data[0:2500]
    z[6100:6200] = data[6100:6200]
    expect = np.full(n, -7.5, dtype=np.float32)
    expect[0:2500] = data[0:2500]
    expect[6100:6200] = data[6100:6200]
    assert not os.path.exists(tmp_path / "z" / "c" / "4")  # missing chunks
    arr = FlatArray.open(tmp_path / "z", io=io, mode="r+")
    assert arr.direct and arr.fill_value == -7.5 and arr.chunk_bytes == 4000
    assert np.array_equal(arr.read().numpy(), expect)
    out = torch.empty(5000)
    arr.read_into(999, 5999, out).result()
    assert np.array_equal(out.numpy(), expect[999:5999])
    # engine writes into a missing chunk of the foreign array: the rest reads as the fill
    arr.write(4100, torch.tensor([1.0, 2.0]))
    expect[4100:4102] = [1, 2]
    assert os.path.getsize(arr.chunk_path(4)) == 4000
    assert np.array_equal(zarr.open_array(tmp_path / "z", mode="r")[:], expect)
    assert np.array_equal(FlatArray.open(tmp_path / "z", io=io).read().numpy(), expect)


def test_engine_reads_zarr_python_bfloat16_and_v2_keys(tmp_path, io):
    vals = np.arange(-50, 50, dtype=np.float32).astype(ml_dtypes.bfloat16)
    z = zarr.create_array(tmp_path / "b", shape=(100,), chunks=(30,), dtype="bfloat16",
                          compressors=None, fill_value=0.5)
    z[:40] = vals[:40]
    got = FlatArray.open(tmp_path / "b", io=io).read()
    expect = vals.copy()
    expect[40:] = 0.5
    assert np.array_equal(got.view(torch.int16).numpy(), expect.view(np.int16))

    z = zarr.create_array(tmp_path / "v2", shape=(100,), chunks=(30,), dtype="int64",
                          compressors=None, chunk_key_encoding={"name": "v2", "separator": "."})
    z[:] = np.arange(100)
    arr = FlatArray.open(tmp_path / "v2", io=io)
    assert arr.chunk_path(1) == str(tmp_path / "v2" / "1")
    assert torch.equal(arr.read(), torch.arange(100))


def test_engine_reads_tensorstore_uncompressed(tmp_path, io):
    spec_meta = {
        "shape": [5000], "data_type": "float32",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1024]}},
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        "fill_value": 3.0,
    }
    t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "t")},
                 "metadata": spec_meta}, create=True).result()
    data = np.random.default_rng(1).standard_normal(5000).astype(np.float32)
    t[0:1500].write(data[0:1500]).result()
    t[4000:5000].write(data[4000:5000]).result()
    expect = np.full(5000, 3.0, dtype=np.float32)
    expect[0:1500], expect[4000:] = data[0:1500], data[4000:]
    arr = FlatArray.open(tmp_path / "t", io=io)
    assert arr.direct
    assert np.array_equal(arr.read().numpy(), expect)

    spec_meta.update(data_type="bfloat16", fill_value=0.0)
    t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "b")},
                 "metadata": spec_meta}, create=True).result()
    vals = np.linspace(-4, 4, 5000).astype(ml_dtypes.bfloat16)
    t.write(vals).result()
    got = FlatArray.open(tmp_path / "b", io=io).read()
    assert np.array_equal(got.view(torch.int16).numpy(), vals.view(np.int16))


# -- arrays the engine cannot serve directly -----------------------------------------------------------
FOREIGN = {
    "zstd": {},  # zarr-python's default compressor
    "big_endian": {"serializer": BytesCodec(endian="big"), "compressors": None},
    "sharded": {"shards": (400,), "compressors": None},
}


@pytest.mark.parametrize("kind", FOREIGN)
def test_non_plain_arrays_read_correctly_or_refused(tmp_path, io, kind):
    z = zarr.create_array(tmp_path / kind, shape=(1000,), chunks=(100,), dtype="float32",
                          fill_value=-1.0, **FOREIGN[kind])
    data = np.arange(1000, dtype=np.float32) * 0.5
    z[:550] = data[:550]
    expect = data.copy()
    expect[550:] = -1.0
    arr = FlatArray.open(tmp_path / kind, io=io, mode="r+")
    assert not arr.direct
    try:
        got = arr.read(95, 705)
    except ForeignArrayError as e:  # refusing is allowed; it must name the array
        assert str(tmp_path / kind) in str(e)
    else:
        assert np.array_equal(got.numpy(), expect[95:705])
    with pytest.raises(ForeignArrayError, match="not supported for direct I/O") as info:
        arr.write(0, torch.zeros(4))
    assert str(tmp_path / kind) in str(info.value)
    assert np.array_equal(zarr.open_array(tmp_path / kind, mode="r")[:], expect)  # untouched


def test_big_endian_bfloat16_is_refused_not_misread(tmp_path, io):
    t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "b")},
                 "metadata": {"shape": [8], "data_type": "bfloat16",
                              "chunk_grid": {"name": "regular",
                                             "configuration": {"chunk_shape": [8]}},
                              "codecs": [{"name": "bytes", "configuration": {"endian": "big"}}]}},
                create=True).result()
    vals = np.arange(8).astype(ml_dtypes.bfloat16)
    t.write(vals).result()
    arr = FlatArray.open(tmp_path / "b", io=io)
    try:
        got = arr.read()
    except ForeignArrayError as e:
        assert "big-endian" in str(e) and str(tmp_path / "b") in str(e)
    else:
        assert np.array_equal(got.view(torch.int16).numpy(), vals.view(np.int16))


def test_multidimensional_array_is_refused(tmp_path, io):
    zarr.create_array(tmp_path / "m", shape=(10, 10), chunks=(5, 5), dtype="float32",
                      compressors=None)
    with pytest.raises(ForeignArrayError, match="2-dimensional") as info:
        FlatArray.open(tmp_path / "m", io=io)
    assert str(tmp_path / "m") in str(info.value)
