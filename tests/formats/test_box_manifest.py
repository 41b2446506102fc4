"""Box shards in our format (docs/format.md, "Boxes"): read back through the one reader,
any element range, and every way a manifest can get boxes wrong is refused by name.

The generations are written by tests/helpers/synthetic.py from tensors in memory (the training
runs that write them are tests/checkpoint/test_checkpoint_mesh.py's): a matrix split into column
blocks (RowwiseParallel), one into rectangles with a replica that saves nothing, a 3-D
tensor split in its last two dimensions, next to an ordinary row split.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random

import pytest
import torch

from offload_engine.formats.errors import CheckpointError
from offload_engine.formats.ours import OursSource
from offload_engine.formats.source import ReadRequest
from offload_engine.layout.box_runs import box_runs
from offload_engine.layout.manifest import BOX_CHECKPOINT_VERSION, METADATA_CRC_VERSION
from helpers.synthetic import reseal, write_checkpoint

WORLD = 4


def tensors():
    g = torch.Generator().manual_seed(0)
    cols = torch.randn(5, 7, generator=g)
    rect = torch.randn(6, 9, generator=g)
    cube = torch.randn(3, 4, 5, generator=g)
    rows = torch.randn(10, 3, generator=g)
    return {
        # column blocks, one per rank (the last rank's empty)
        "cols": {"shape": [5, 7], "dtype": torch.float32, "optimizer": "muon",
                 "states": {"param": cols, "momentum_buffer": cols * 2},
                 "boxes": [([0, 0], [5, 3]), ([0, 3], [5, 2]), ([0, 5], [5, 2]), None]},
        # 2 x 2 rectangles over ranks 0, 1, 3; rank 2 (a replica) saves none
        "rect": {"shape": [6, 9], "dtype": torch.float32, "optimizer": "muon",
                 "states": {"param": rect},
                 "boxes": [([0, 0], [4, 5]), ([0, 5], [4, 4]), None, ([4, 0], [2, 9])]},
        "cube": {"shape": [3, 4, 5], "dtype": torch.float32, "optimizer": None,
                 "states": {"param": cube},
                 "boxes": [([0, 0, 0], [3, 2, 5]), ([0, 2, 0], [3, 2, 2]),
                           ([0, 2, 2], [3, 2, 3]), None]},
        "rows": {"shape": [10, 3], "dtype": torch.float32, "optimizer": "adamw",
                 "states": {"param": rows}},
    }


def gen(tmp_path, version=BOX_CHECKPOINT_VERSION, edit=None) -> str:
    specs = tensors()
    if edit:
        edit(specs)
    return write_checkpoint(str(tmp_path / "ck"), specs, WORLD, step=5, format_version=version,
                            chunk_bytes=4096)


def read(src, name, state, lo, hi) -> torch.Tensor:
    out = torch.empty(hi - lo, dtype=torch.float32)
    src.read([ReadRequest(name, lo, out, state)])
    return out


def test_box_runs_cover_every_box_element_once_in_order():
    rng = random.Random(0)
    for _ in range(2000):
        shape = [rng.randint(1, 5) for _ in range(rng.randint(0, 3))]
        start = [rng.randint(0, s - 1) for s in shape]
        ext = [rng.randint(0, s - a) for s, a in zip(shape, start)]
        total = math.prod(shape)
        lo = rng.randint(0, total)
        hi = rng.randint(lo, total)
        want = []
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        for j, idx in enumerate(itertools.product(*[range(e) for e in ext])):
            flat = sum((s + i) * t for s, i, t in zip(start, idx, strides))
            if lo <= flat < hi:
                want.append((flat, j))
        got = [(d + i, b + i) for d, b, n in box_runs(shape, start, ext, lo, hi) for i in range(n)]
        assert got == want, (shape, start, ext, lo, hi)


def test_boxes_read_back_whole_and_in_any_range(tmp_path):
    specs = tensors()
    with OursSource.open_checkpoint(gen(tmp_path)) as src:
        assert src.info.format_version == BOX_CHECKPOINT_VERSION
        listed = {t.name: t for t in src.tensors()}
        # listing: bytes per rank from the boxes, in the tensor table alone
        assert listed["cols"].states["param"].bytes_by_rank == {0: 60, 1: 40, 2: 40, 3: 0}
        assert listed["rect"].states["param"].bytes_by_rank == {0: 80, 1: 64, 2: 0, 3: 72}
        rng = random.Random(1)
        for name, spec in specs.items():
            for state, value in spec["states"].items():
                flat = value.reshape(-1)
                assert torch.equal(read(src, name, state, 0, flat.numel()), flat), name
                for _ in range(20):
                    lo = rng.randint(0, flat.numel() - 1)
                    hi = rng.randint(lo + 1, flat.numel())
                    assert torch.equal(read(src, name, state, lo, hi), flat[lo:hi]), (name, lo, hi)


def test_a_rank_without_arrays_reads_in_version_4(tmp_path):
    def only_ranks_0_1(specs):
        del specs["rows"], specs["cube"]
        specs["cols"]["boxes"] = [([0, 0], [5, 4]), ([0, 4], [5, 3]), None, None]
        specs["rect"]["boxes"] = [([0, 0], [6, 5]), ([0, 5], [6, 4]), None, None]
    g = gen(tmp_path, edit=only_ranks_0_1)
    assert sorted(os.listdir(os.path.join(g, "rank3"))) == ["zarr.json"]
    with OursSource.open_checkpoint(g) as src:
        want = tensors()["rect"]["states"]["param"].reshape(-1)
        assert torch.equal(read(src, "rect", "param", 0, 54), want)


def edited(g: str, what: str, change) -> None:
    """Apply ``change`` to the manifest (``what`` = "manifest") or to a rank's shard table
    (``"rank1"``), then reseal as a forger would: the reader's own checks must refuse it."""
    path = os.path.join(g, "zarr.json") if what == "manifest" else os.path.join(g, what, "zarr.json")
    with open(path) as f:
        doc = json.load(f)
    change(doc["attributes"])
    with open(path, "w") as f:
        json.dump(doc, f)
    reseal(g)


def refused(g: str, match: str, data: bool = True) -> None:
    with pytest.raises(CheckpointError, match=match):
        with OursSource.open_checkpoint(g) as src:
            if data:
                read(src, "cols", "param", 0, 35)
                read(src, "rect", "param", 0, 54)


def test_boxes_in_a_version_3_manifest_are_refused(tmp_path):
    g = gen(tmp_path, version=METADATA_CRC_VERSION)
    refused(g, r"tensor 'cols' has 'boxes_per_rank', which format_version 4 introduced", data=False)


def test_overlapping_boxes_are_refused_at_read(tmp_path):
    g = gen(tmp_path)

    def overlap(attrs):  # the same element count, but rank 1's box moved onto rank 0's
        attrs["tensors"]["cols"]["boxes_per_rank"][1] = [[0, 2], [5, 2]]
    edited(g, "manifest", overlap)
    edited(g, "rank1", lambda a: a["shards"]["cols"].update(start=[0, 2]))
    refused(g, r"tensor 'cols': boxes start=\[0, 0\] shape=\[5, 3\] and start=\[0, 2\] "
               r"shape=\[5, 2\] of 'boxes_per_rank' overlap")


@pytest.mark.parametrize("change, match", [
    (lambda a: a["tensors"]["cols"]["boxes_per_rank"].pop(),
     r"tensor 'cols': 'boxes_per_rank' must list the box of each of the 4 ranks"),
    (lambda a: a["tensors"]["cols"]["boxes_per_rank"].__setitem__(0, [[0, 0], [6, 3]]),
     r"tensor 'cols': rank 0's box must be \[start, shape\], two lists of 2 integers >= 0 "
     r"inside its shape \[5, 7\]"),
    (lambda a: a["tensors"]["cols"]["boxes_per_rank"].__setitem__(0, [[0, 0], [5]]),
     r"rank 0's box must be \[start, shape\]"),
    (lambda a: a["tensors"]["cols"]["boxes_per_rank"].__setitem__(2, None),
     r"tensor 'cols': the boxes of 'boxes_per_rank' hold 25 elements, the tensor has 35"),
])
def test_a_bad_box_table_is_refused_naming_the_tensor(tmp_path, change, match):
    g = gen(tmp_path)
    edited(g, "manifest", change)
    refused(g, match, data=False)


@pytest.mark.parametrize("change, match", [
    (lambda a: a["shards"]["cols"].update(start=[0, 4]),
     r"tensor 'cols': rank 1's shard is the box start=\[0, 4\] shape=\[5, 2\], the tensor "
     r"table's boxes_per_rank gives it start=\[0, 3\] shape=\[5, 2\]"),
    (lambda a: a["shards"]["cols"].update(numel=11),
     r"tensor 'cols', rank 1: numel 11 is not the 10 elements of its box"),
    (lambda a: a["shards"]["cols"].pop("start"), r"rank 1's shard is the box start=None"),
    (lambda a: a["shards"].pop("cols"),
     r"tensor 'cols': rank 1's box is in no shard \(its shard table has no entry; the tensor "
     r"table gives it 10 elements\)"),
    (lambda a: a["shards"].__setitem__("cols", {   # a row entry where a box is due
        "row_start": 0, "rows": 5, "numel": 10, "states": a["shards"]["cols"]["states"]}),
     r"rank 1's shard is the box start=None shape=None, the tensor table's boxes_per_rank "
     r"gives it start=\[0, 3\]"),
])
def test_a_shard_that_is_not_its_box_is_refused(tmp_path, change, match):
    g = gen(tmp_path)
    edited(g, "rank1", change)
    refused(g, match)


def test_inspect_diff_export_and_consolidate_read_boxes(tmp_path, capsys):
    """Every offline command reads box shards through the reader: a generation of boxes
    equals (diff, exit 0) one of the same tensors as FSDP2 row blocks, exports and
    consolidates to the tensors themselves."""
    import numpy as np
    from offload_engine.cli.main import main
    from offload_engine.consolidate import get_fp32_state_dict

    boxes = gen(tmp_path)
    specs = tensors()
    for spec in specs.values():
        spec.pop("boxes", None)
    rows = write_checkpoint(str(tmp_path / "rows"), specs, 3, step=5, chunk_bytes=4096)
    assert main(["inspect", boxes]) == 0
    assert main(["inspect", boxes, "--stats"]) == 0
    assert main(["diff", boxes, rows, "--state", "all"]) == 0
    specs["cols"]["states"]["param"][2, 5] += 1        # one element of rank 2's box
    other = write_checkpoint(str(tmp_path / "other"), specs, 3, step=5, chunk_bytes=4096)
    assert main(["diff", boxes, other]) == 1
    out = str(tmp_path / "rect.npy")
    assert main(["export", boxes, "rect", "--out", out]) == 0
    assert np.array_equal(np.load(out), tensors()["rect"]["states"]["param"].numpy())
    whole = get_fp32_state_dict(str(tmp_path / "ck"))
    for name, spec in tensors().items():
        assert torch.equal(whole[name], spec["states"]["param"]), name
    capsys.readouterr()
