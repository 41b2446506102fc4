"""A generation of ours whose manifest (its zarr.json) cannot be read is reported as ours,
with what is wrong and the file, however it is reached (the folder holding ``latest``, the
generation itself, ``--tag``, a folder of generations without ``latest``), never as "not
a DeepSpeed checkpoint" or "not a store, a checkpoint, ..."."""

from __future__ import annotations

import os

import pytest
import torch

from offload_engine.cli.main import main

from helpers.synthetic import write_checkpoint

TENSORS = {"w": {"shape": [6, 4], "dtype": torch.float32, "optimizer": "adamw",
                 "states": {"param": torch.arange(24, dtype=torch.float32).reshape(6, 4)}}}
GEN = "step-00000004"

DAMAGE = {
    "truncated": (lambda text: text[: len(text) // 2], "not valid JSON"),
    "empty": (lambda text: "", "not valid JSON"),
    "not-an-object": (lambda text: "[1, 2]\n", "must hold a JSON object"),
    "no-zarr-format": (lambda text: text.replace('"zarr_format":3,', ""), "zarr_format"),
}
REACHED = {
    "latest": lambda ck: [ck],
    "generation": lambda ck: [os.path.join(ck, GEN)],
    "tag": lambda ck: [ck, "--tag", GEN],
}


@pytest.mark.parametrize("how", sorted(REACHED))
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_broken_manifest_is_reported_as_ours(tmp_path, capsys, damage, how):
    ck = str(tmp_path / "ck")
    write_checkpoint(ck, TENSORS, world_size=2, step=4)
    manifest = os.path.join(ck, GEN, "zarr.json")
    edit, needle = DAMAGE[damage]
    with open(manifest) as f:
        text = f.read()
    with open(manifest, "w") as f:
        f.write(edit(text))
    argv = REACHED[how](ck)
    rc = main(["consolidate", argv[0], str(tmp_path / "hf"), *argv[1:]])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "offload-engine checkpoint" in err and manifest in err and needle in err, err
    assert "ZeRO" not in err and "DeepSpeed" not in err, err


def test_folder_of_generations_without_latest_names_the_broken_one(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    write_checkpoint(ck, TENSORS, world_size=2, step=4)
    os.remove(os.path.join(ck, "latest"))
    with open(os.path.join(ck, GEN, "zarr.json"), "w") as f:
        f.write("{")
    rc = main(["consolidate", ck, str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "no 'latest' file" in err and GEN in err, err
