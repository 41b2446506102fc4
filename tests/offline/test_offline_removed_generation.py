"""consolidate, inspect, diff and export reading a generation that ``keep_last`` removes
under them (issue 30, item 9): one line, exit 2, saying the generation was removed and to
run again on ``latest``, not that the checkpoint is corrupt; a file missing from a
generation that is still there stays corruption.

In-process through ``cli.main.main``; the race is planted where every reader of our format
starts reading data (``OursSource._before_data``): the writer's retention runs right then."""

from __future__ import annotations

import os

import pytest

from offload_engine.checkpoint import save_checkpoint
from offload_engine.checkpoint.retention import apply_retention
from offload_engine.cli import main as cli
from offload_engine.formats.ours import OursSource

from helpers.forged import fresh_model, train

OLD, NEW = "step-00000001", "step-00000002"


@pytest.fixture
def ck(tmp_path):
    """A checkpoint folder with generations step-1 and step-2 (latest)."""
    path = str(tmp_path / "ck")
    model, opt = fresh_model(str(tmp_path / "writer"))
    for step in (1, 2):
        train(model, opt, [step])
        save_checkpoint(path, model, opt, step)
    opt.close()
    return path


def commands(ck: str, tmp: str) -> dict[str, list[str]]:
    gen = os.path.join(ck, OLD)
    return {
        "consolidate": ["consolidate", ck, os.path.join(tmp, "out"), "--tag", OLD],
        "inspect": ["inspect", gen, "--stats"],
        "diff": ["diff", gen, os.path.join(ck, NEW)],
        "export": ["export", gen, "w", "--out", os.path.join(tmp, "w.npy")],
    }


@pytest.mark.parametrize("command", ["consolidate", "inspect", "diff", "export"])
def test_a_generation_removed_while_read_is_one_line_saying_so(ck, tmp_path, monkeypatch,
                                                              capsys, command):
    real = OursSource._before_data

    def racing(self):
        if os.path.basename(self.group) == OLD and os.path.isdir(self.group):
            apply_retention(ck, 1, NEW)  # the writer's keep_last=1, right now
        real(self)
    monkeypatch.setattr(OursSource, "_before_data", racing)
    code = cli.main(commands(ck, str(tmp_path))[command])
    _, err = capsys.readouterr()
    assert not os.path.exists(os.path.join(ck, OLD))
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"generation {OLD} was removed while being read" in err
    assert "run the command again" in err and "'latest'" in err
    assert "crc32c" not in err.split("(", 1)[0]  # not reported as corruption


@pytest.mark.parametrize("command", ["consolidate", "inspect", "diff", "export"])
def test_a_file_missing_from_a_generation_still_there_stays_corruption(ck, tmp_path, capsys,
                                                                      command):
    gen = os.path.join(ck, OLD)
    os.remove(os.path.join(gen, "rank0", "zarr.json"))  # rank 0's shard table
    code = cli.main(commands(ck, str(tmp_path))[command])
    _, err = capsys.readouterr()
    assert code == 2, err
    assert "was removed while being read" not in err
    assert "missing" in err, err
