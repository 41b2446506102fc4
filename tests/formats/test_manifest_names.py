"""Array names in a manifest never lead out of the checkpoint directory: not absolute, no
``..``, no symlink pointing out. Every reader (load, consolidate, inspect, diff, export)
refuses them before it opens anything there, even when the bytes found there would match
the recorded checksums (here: a copy of the same checkpoint)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from helpers.forged import edit_group, fresh_model, small_checkpoint
from helpers.synthetic import reseal
from offload_engine.checkpoint import load_checkpoint
from offload_engine.cli.main import main
from offload_engine.formats.errors import CheckpointError
from offload_engine.formats.ours import OursSource

GEN = "step-00000002"
ARRAY = "rank0/param"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return small_checkpoint(str(tmp_path_factory.mktemp("names")))


def rename_array(gen: str, old: str, new: str) -> None:
    """Call array ``old`` ``new`` everywhere the manifest and shard table name it."""
    def top(a):
        a["arrays"][new] = a["arrays"].pop(old)
        a["checksums"][new] = a["checksums"].pop(old)

    def table(a):
        for shard in a["shards"].values():
            for ref in shard["states"].values():
                if ref["array"] == old:
                    ref["array"] = new
    edit_group(os.path.join(gen, "rank0", "zarr.json"), table)
    edit_group(os.path.join(gen, "zarr.json"), top)
    reseal(gen)  # as a forger would: the checksums alone must not be what stops it


def escaping(kind: str, saved: str, tmp) -> tuple[str, str]:
    """(checkpoint dir, what the error says) for an array name of ``kind`` that leads to the
    same array of an identical copy of the checkpoint."""
    ck, other = str(tmp / "ck"), str(tmp / "other")
    shutil.copytree(saved, ck)
    shutil.copytree(saved, other)
    gen = os.path.join(ck, GEN)
    target = os.path.join(other, GEN, ARRAY)
    if kind == "dotdot":
        rename_array(gen, ARRAY, os.path.relpath(target, gen))
        return ck, "'..' part"
    if kind == "absolute":
        rename_array(gen, ARRAY, target)
        return ck, "absolute path"
    shutil.rmtree(os.path.join(gen, ARRAY))
    os.symlink(target, os.path.join(gen, ARRAY))
    return ck, "leads out of"


KINDS = ["dotdot", "absolute", "symlink"]


@pytest.mark.parametrize("kind", KINDS)
def test_load_refuses_names_leading_out(saved, tmp_path, kind):
    ck, needle = escaping(kind, saved, tmp_path)
    with pytest.raises(CheckpointError, match=needle):
        with OursSource.open_checkpoint(ck) as src:
            for t in src.tensors():
                for state, sm in t.states.items():
                    src.read_state(t.name, state, 0, torch.empty(sm.numel, dtype=sm.dtype.torch))
    model, opt = fresh_model(str(tmp_path / "load-state"), seed=1)
    try:
        with pytest.raises(CheckpointError, match=needle):
            load_checkpoint(ck, model, opt)
    finally:
        opt.close()


COMMANDS = {
    "consolidate": lambda ck, t: ["consolidate", ck, str(t / "hf"), "--verify"],
    "inspect": lambda ck, t: ["inspect", ck, "--stats"],
    "export": lambda ck, t: ["export", ck, "w", "--state", "param", "--out", str(t / "w.npy")],
    "diff": lambda ck, t: ["diff", ck, ck],
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_commands_refuse_names_leading_out(saved, tmp_path, capsys, kind, command):
    ck, needle = escaping(kind, saved, tmp_path)
    rc = main(COMMANDS[command](ck, tmp_path))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert needle in err and "rank0/param" in err, err
    assert not os.path.exists(tmp_path / "hf" / "model.safetensors")
    assert not os.path.exists(tmp_path / "w.npy")
