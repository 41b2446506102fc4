"""The store's on-disk pieces in layout/: striping chunk files over NVMe directories, and
the store group's manifest (what TieredStore writes; docs/format.md)."""

import json
import os

import pytest

from offload_engine.io import AsyncFileIO
from offload_engine.layout import FlatArray, read_group
from offload_engine.layout.store_group import (STORE_FORMAT, open_store_group, store_array_entry,
                                               write_store_group)
from offload_engine.layout.striping import stripe_chunks, stripe_index


def test_chunks_go_round_robin_and_links_keep_the_zarr_keys(tmp_path):
    a, b, c = (str(tmp_path / d) for d in "abc")
    with AsyncFileIO(threads=1, queue_depth=1) as io:
        flat = FlatArray.create(os.path.join(a, "m"), 5 * 1024, "float32", io=io, chunk_bytes=4096)
        os.makedirs(os.path.join(a, "m", "c"), exist_ok=True)
        open(flat.chunk_path(0), "wb").close()               # unstriped chunk: stays put
        open(flat.chunk_path(1), "wb").close()               # plain, from an unstriped run: kept
        stripe_chunks(flat, "m", [a, b, c])
        stripe_chunks(flat, "m", [a, b, c])                  # idempotent
    assert [stripe_index(i, 3) for i in range(5)] == [0, 1, 2, 0, 1]
    for i, d in ((2, c), (4, b)):
        link = flat.chunk_path(i)
        assert os.path.islink(link)
        assert os.readlink(link) == os.path.join(d, "stripes", "m", "c", str(i))
    assert not any(os.path.islink(flat.chunk_path(i)) for i in (0, 1, 3))
    assert os.path.isdir(os.path.join(b, "stripes", "m", "c"))


def test_one_directory_means_no_links(tmp_path):
    with AsyncFileIO(threads=1, queue_depth=1) as io:
        flat = FlatArray.create(str(tmp_path / "m"), 3 * 1024, "float32", io=io, chunk_bytes=4096)
        stripe_chunks(flat, "m", [str(tmp_path)])
    assert os.listdir(tmp_path / "m" / "c") == []


def test_store_group_keeps_other_entries_and_owns_its_keys(tmp_path):
    root = str(tmp_path / "store")
    assert open_store_group(root) == {}                      # created
    arrays = {"rank0/m": store_array_entry("float32", 3000, "nvme", 1024)}
    write_store_group(root, arrays, [root], {"world_size": 2, "step": 7})
    attrs = read_group(root)
    # the layers above first, then the store's keys (the bytes on disk depend on this order)
    assert list(attrs) == ["world_size", "step", "format", "format_version", "arrays", "stripes"]
    assert attrs["format"] == STORE_FORMAT and attrs["arrays"] == arrays
    assert open_store_group(root) == {"world_size": 2, "step": 7}   # reopened
    with pytest.raises(ValueError, match="belong to the store"):
        write_store_group(root, arrays, [root], {"arrays": {}})
    text = open(os.path.join(root, "zarr.json")).read()
    assert "\n" not in text.rstrip("\n") and json.loads(text)["node_type"] == "group"


def test_a_group_of_another_kind_is_refused(tmp_path):
    from offload_engine.layout import create_group
    create_group(str(tmp_path), {"format": "offload-engine-checkpoint"})
    with pytest.raises(ValueError, match="not an offload-engine store"):
        open_store_group(str(tmp_path))
