"""Inputs the readers must refuse, or must accept, at their edges: torn generations, a live
store given to the consolidator, stray folders beside a safetensors file, tied names, dtype
codes the planner does not know. Each refusal names the file and exits 2 from the CLI."""

import json
import os
import shutil
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from offload_engine import dtypes
from offload_engine.cli.main import main
from offload_engine.formats import ReadRequest, open_source
from offload_engine.formats.deepspeed import DeepSpeedSource
from offload_engine.formats.errors import CheckpointError, FormatError
from offload_engine.formats.ours import OursSource
from offload_engine.formats.safetensors import SafetensorsSource
from offload_engine.io import AsyncFileIO
from offload_engine.layout import FlatArray
from offload_engine.plan.model_shapes import load_model

from helpers.synthetic import write_checkpoint, write_sharded
from helpers.paths import DEEPSPEED_FIXTURES as FIXTURES


TENSORS = {
    "w": {"shape": [6, 4], "dtype": torch.float32, "optimizer": "adamw",
          "states": {"param": torch.arange(24, dtype=torch.float32).reshape(6, 4)}},
}


def _torn_checkpoint(root) -> str:
    """A checkpoint folder whose only generation is a ``.partial`` one (a crash before the
    rename), with ``latest`` naming it as a hand-edited or buggy writer might."""
    gen = write_checkpoint(str(root), TENSORS, world_size=2, step=4)
    torn = gen + ".partial"
    os.rename(gen, torn)
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(os.path.basename(torn) + "\n")
    return torn


def test_torn_generation_is_never_loaded(tmp_path):
    torn = _torn_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="torn"):
        OursSource.open_checkpoint(str(tmp_path))           # through latest
    with pytest.raises(CheckpointError, match="torn"):
        OursSource.open_checkpoint(torn)                    # the folder itself
    with pytest.raises(CheckpointError, match="torn"):
        OursSource.open_checkpoint(str(tmp_path), os.path.basename(torn))  # as a tag
    # the committed name is asked for: it does not exist, and the message says why
    with pytest.raises(CheckpointError, match="only a torn .partial copy exists"):
        OursSource.open_checkpoint(str(tmp_path), "step-00000004")


@pytest.mark.parametrize("command", ["consolidate", "inspect"])
def test_cli_refuses_torn_generation(tmp_path, capsys, command):
    torn = _torn_checkpoint(tmp_path / "ck")
    extra = [str(tmp_path / "out")] if command == "consolidate" else []
    for target in (str(tmp_path / "ck"), torn):
        assert main([command, target, *extra]) == 2
        err = capsys.readouterr().err
        assert "torn" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_consolidate_refuses_a_live_store(tmp_path, capsys):
    store = str(tmp_path / "store")
    write_sharded(store, TENSORS, world_size=2, kind="store")
    with open_source(store) as src:      # the reader opens it (inspect uses this) ...
        assert src.info.kind == "store"
    # ... but a store holds optimizer state, not weights: nothing is written from it
    assert main(["consolidate", store, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert store in err and "store" in err
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_stray_folders_beside_safetensors_do_not_block_detection(tmp_path):
    t = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    save_file(t, str(tmp_path / "model.safetensors"))
    (tmp_path / "logs").mkdir()                       # no zarr.json at all
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "zarr.json").write_bytes(b"\x00not json")   # a broken one
    (tmp_path / "ck.partial").mkdir()                  # a torn generation beside it
    with open_source(str(tmp_path)) as src:
        assert src.info.kind == "safetensors"
        out = torch.empty(6)
        src.read([ReadRequest("a", 0, out)])
        assert torch.equal(out, t["a"].flatten())


def test_dtype_table_refuses_none_and_big_endian():
    with pytest.raises((TypeError, ValueError)):
        dtypes.dtype(None)
    with pytest.raises((TypeError, ValueError)):
        dtypes.dtype(np.dtype(">f4"))
    assert dtypes.dtype(np.dtype("<f4")) is dtypes.dtype("float32")


def test_flat_array_moves_raw_bytes_or_its_own_dtype(tmp_path):
    io = AsyncFileIO(threads=2, queue_depth=2)
    try:
        arr = FlatArray.create(str(tmp_path / "a"), 10, torch.float32, io=io, chunk_bytes=4096)
        values = np.linspace(-1, 1, 10, dtype=np.float32)
        arr.write_from(0, 10, values.view(np.uint8), sync=True).result()    # raw bytes
        raw = np.zeros(40, dtype=np.uint8)
        arr.read_into(0, 10, raw).result()
        assert np.array_equal(raw.view(np.float32), values)
        same = np.zeros(10, dtype=np.float32)                               # its own dtype
        arr.read_into(0, 10, same).result()
        assert np.array_equal(same, values)
        with pytest.raises(ValueError, match="float64"):                   # anything else
            arr.read_into(0, 10, np.zeros(10, dtype=np.float64))
        with pytest.raises(ValueError, match="int32"):
            arr.write_from(0, 10, np.zeros(10, dtype=np.int32))
    finally:
        io.close()


def test_planner_reads_headers_it_cannot_load(tmp_path):
    """A header the consolidator would refuse (a dtype code outside our table, an entry with
    no data_offsets, no data at all) still gives the planner names and shapes."""
    header = {"w": {"dtype": "F8_E8M0", "shape": [64, 32]},
              "b": {"dtype": "BF16", "shape": [32], "data_offsets": [0, 64]}}
    raw = json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)   # cut off after the header
    model = load_model(str(path))
    assert {t.name: tuple(t.shape) for t in model.tensors} == {"w": (64, 32), "b": (32,)}
    assert model.numel == 64 * 32 + 32
    with pytest.raises(FormatError, match="F8_E8M0"):
        SafetensorsSource(str(path))


def test_tied_name_reads_its_owner(tmp_path):
    """A DeepSpeed tied name (``shared_params``) and a safetensors alias read the owner."""
    with DeepSpeedSource(os.path.join(FIXTURES, "zero3_w3_fp32")) as src:
        alias, owner = next(iter(src.aliases().items()))
        n = next(t.numel for t in src.tensors() if t.name == owner)
        a, b = torch.empty(n), torch.empty(n)
        src.read([ReadRequest(alias, 0, a), ReadRequest(owner, 0, b)])
        assert torch.equal(a, b) and a.abs().sum() > 0
    t = {"emb": torch.randn(4, 3)}
    save_file(t, str(tmp_path / "model.safetensors"), metadata={"head": "emb"})
    with SafetensorsSource(str(tmp_path / "model.safetensors")) as src:
        assert src.aliases() == {"head": "emb"}
        out = torch.empty(12)
        src.read([ReadRequest("head", 0, out)])
        assert torch.equal(out, t["emb"].flatten())
