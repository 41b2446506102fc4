"""``latest`` is a line a person may write (with or without a final newline) or garbage: a
garbage one is one line on stderr naming the file, exit 2, and none of its bytes reach the
terminal as they are."""

from __future__ import annotations

import os

import pytest
import torch

from offload_engine.cli.main import main
from offload_engine.formats.errors import CheckpointError
from offload_engine.formats.ours import OursSource

from helpers.synthetic import write_checkpoint

TENSORS = {"w": {"shape": [6, 4], "dtype": torch.float32, "optimizer": "adamw",
                 "states": {"param": torch.arange(24, dtype=torch.float32).reshape(6, 4)}}}
GEN = "step-00000004"

GARBAGE = {
    "not-utf8": (b"\xff\xfe\x00\x9c garbage", "not UTF-8"),
    "nul": (b"step-0000\x004\n", "control character"),
    "two-lines": (GEN.encode() + b"\nstep-00000003\n", "control character"),
    "escape": (b"\x1b[2J\x1b[31m" + GEN.encode(), "control character"),
    "blank": (b" " + GEN.encode() + b"\n", "blank"),
    "vertical-tab": (GEN.encode() + b"\x0b", "control character"),
    "lone-cr": (GEN.encode() + b"\r", "control character"),
    "empty": (b"", "is empty"),
    "path": (b"../" + GEN.encode(), "is a path"),
    "huge": (b"a" * 100_000, "longer than"),
}


@pytest.fixture
def ck(tmp_path):
    write_checkpoint(str(tmp_path / "ck"), TENSORS, world_size=2, step=4)
    return str(tmp_path / "ck")


@pytest.mark.parametrize("case", sorted(GARBAGE))
def test_garbage_latest_is_one_clean_line(ck, tmp_path, capsys, case):
    content, needle = GARBAGE[case]
    latest = os.path.join(ck, "latest")
    with open(latest, "wb") as f:
        f.write(content)
    for argv in (["consolidate", ck, str(tmp_path / "hf")], ["inspect", ck]):
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2, err
        assert err.endswith("\n") and err.count("\n") == 1 and "Traceback" not in err, err
        assert latest in err and needle in err, err
        assert all(c == "\n" or 0x20 <= ord(c) != 0x7F for c in err), repr(err)
    with pytest.raises(CheckpointError, match=needle):
        OursSource.open_checkpoint(ck)


@pytest.mark.parametrize("content", [GEN + "\n", GEN, GEN + "\r\n"])
def test_names_people_write_are_followed(ck, capsys, content):
    with open(os.path.join(ck, "latest"), "w", newline="") as f:
        f.write(content)
    with OursSource.open_checkpoint(ck) as src:
        assert src.info.generation == GEN
    assert main(["inspect", ck]) == 0, capsys.readouterr().err
