"""What scripts and shells rely on from the command line: DeepSpeed's zero_to_fp32 flag
spellings, --json from consolidate and export, --version, a quiet exit on a closed pipe,
and tied names listed by inspect."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from offload_engine import __version__
from offload_engine.cli.main import main

from helpers.consolidate_outputs import load_output
from helpers.paths import ROOT

DS = os.path.join(ROOT, "tests", "fixtures", "deepspeed", "zero3_w3_fp32")


def test_deepspeed_spellings_do_what_ours_do(tmp_path, capsys):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    assert main(["consolidate", DS, str(ours), "--tag", "global_step2", "--max-shard-size",
                 "2KB", "--exclude-frozen"]) == 0
    # a zero_to_fp32.py command line, flags as DeepSpeed spells them
    assert main(["consolidate", DS, str(theirs), "-t", "global_step2", "--max_shard_size", "2KB",
                 "--exclude_frozen_parameters", "--safe_serialization"]) == 0
    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
    got_ours, aliases_ours = load_output(ours)
    got_theirs, aliases_theirs = load_output(theirs)
    assert aliases_ours == aliases_theirs == {"head.weight": "emb.weight"}
    assert set(got_ours) == set(got_theirs) and "frozen.weight" not in got_theirs
    assert len(os.listdir(theirs)) > 2  # --max_shard_size took effect: shards and index
    for k in got_ours:
        assert torch.equal(got_ours[k], got_theirs[k]), k


def test_deepspeed_tag_spelling_picks_the_tag(tmp_path, capsys):
    assert main(["consolidate", DS, str(tmp_path / "o"), "-t", "global_step9"]) == 2
    assert "global_step9" in capsys.readouterr().err


def test_spellings_stay_out_of_help(capsys):
    with pytest.raises(SystemExit):
        main(["consolidate", "--help"])
    text = capsys.readouterr().out
    assert "--max-shard-size" in text and "--max_shard_size MAX_SHARD_SIZE" not in text


def test_consolidate_json_says_what_was_written(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["consolidate", DS, str(out), "--json", "--verify", "--max-shard-size", "2KB"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted(f["name"] for f in report["files"]) == sorted(os.listdir(out))
    assert all(f["bytes"] == os.path.getsize(out / f["name"]) for f in report["files"])
    assert report["tensors"] == 8 and report["aliases"] == {"head.weight": "emb.weight"}
    assert report["tensor_bytes"] == sum(t.numel() * t.element_size()
                                         for t in load_output(out)[0].values())
    assert report["verified"] is True and report["source"]["kind"] == "deepspeed"
    assert report["seconds"] >= report["write_seconds"] >= 0


def test_consolidate_json_reports_a_failed_verify(tmp_path, capsys, monkeypatch):
    import offload_engine.cli.consolidate as cli

    monkeypatch.setattr(cli, "verify_output", lambda *a, **k: ["model.safetensors: l1.weight differs"])
    assert main(["consolidate", DS, str(tmp_path / "o"), "--json", "--verify"]) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["verified"] is False and report["verify_problems"]
    assert "l1.weight differs" in captured.err


def test_export_json(tmp_path, capsys):
    out = tmp_path / "w.safetensors"
    assert main(["export", DS, "l1.weight", "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["name"] == "l1.weight" and report["state"] == "master"
    assert report["shape"] == [13, 16] and report["bytes"] == os.path.getsize(out)


@pytest.mark.multiprocess
def test_version_loads_no_command():
    code = ("import sys\nfrom offload_engine.cli.main import main\n"
            "try:\n    main(['--version'])\nexcept SystemExit as e:\n    rc = e.code\n"
            "print(rc, *(m in sys.modules for m in ('torch', 'numpy', 'shtab', 'tqdm')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    version, loaded = proc.stdout.splitlines()
    assert version.startswith(f"offload-engine {__version__} (torch ") and loaded == "0 False False False False"


@pytest.mark.multiprocess
def test_closed_pipe_exits_quietly(tmp_path):
    """`offload-engine inspect BIG | head -1`: the listing is larger than the pipe's buffer,
    so writes hit a closed pipe; the command stops without a message."""
    path = tmp_path / "many.safetensors"
    save_file({f"layers.{i}.some_long_module_name.weight": torch.zeros(1) for i in range(4000)},
              str(path))
    script = (f"{sys.executable} -c 'from offload_engine.cli.main import entry; entry()' "
              f"inspect {path} | head -1; echo \"rc=${{PIPESTATUS[0]}}\"")
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("kind") and lines[-1] == "rc=141"
    assert proc.stderr == ""


def test_inspect_lists_tied_names(capsys):
    assert main(["inspect", DS]) == 0
    text = capsys.readouterr().out
    assert "tied        head.weight = emb.weight" in text
    rows = [line.split() for line in text.splitlines() if line.strip()]
    names = [r[0] for r in rows]
    assert names.index("head.weight") == names.index("emb.weight") + 1  # right after its owner
    assert rows[names.index("head.weight")][-2:] == ["=", "emb.weight"]
    assert main(["inspect", DS, "--json", "--name", "head.*"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["summary"]["aliases"] == {"head.weight": "emb.weight"}
    assert report["tensors"] == [{"name": "head.weight", "shape": [37, 16], "dtype": "float32",
                                  "optimizer": None, "kind": "tied", "tied_to": "emb.weight",
                                  "states": [], "bytes": 0}]
