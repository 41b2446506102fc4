"""Names from an input (tensor names, file names) reach a terminal escaped: ESC, newlines
and other non-printable characters as Python escapes in human output, exact in --json."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from offload_engine.cli.main import main
from offload_engine.cli.printable import printable

EVIL = "evil\x1b[2J\nrow.weight"  # clears the screen, then forges a row of the listing
SHOWN = "evil\\x1b[2J\\nrow.weight"


@pytest.fixture
def evil_file(tmp_path):
    path = tmp_path / "evil.safetensors"
    save_file({EVIL: np.ones(3, np.float32), "ok.weight": np.zeros(2, np.float32)}, str(path))
    return str(path)


def _human(capsys) -> str:
    out = capsys.readouterr()
    text = out.out + out.err
    assert "\x1b" not in text, text
    return text


def test_printable_escapes_what_a_terminal_acts_on():
    assert printable(EVIL) == SHOWN
    assert printable("model.layers.0.mlp.weight") == "model.layers.0.mlp.weight"
    assert printable("a\tb\x7f\x9bc\u202ed") == "a\\tb\\x7f\\x9bc\\u202ed"  # DEL, CSI, bidi
    assert printable("poids.ü.权重") == "poids.ü.权重"  # printable non-ASCII stays


def test_inspect_escapes_names_and_json_keeps_them(evil_file, capsys):
    assert main(["inspect", evil_file, "--stats"]) == 0
    text = _human(capsys)
    assert f"\n{SHOWN}  " in text and "\nrow.weight" not in text
    assert main(["inspect", evil_file, "--json"]) == 0
    names = [t["name"] for t in json.loads(capsys.readouterr().out)["tensors"]]
    assert EVIL in names


def test_diff_export_and_errors_escape_names(evil_file, tmp_path, capsys):
    other = str(tmp_path / "other.safetensors")
    save_file({"ok.weight": np.zeros(2, np.float32)}, other)
    assert main(["diff", evil_file, other]) == 1
    assert f"only in A (1): {SHOWN}\n" in _human(capsys)
    assert main(["export", evil_file, EVIL, "--out", str(tmp_path / "t.npy")]) == 0
    assert f"wrote {SHOWN} (" in _human(capsys)
    assert main(["inspect", str(tmp_path / "no\x1b[2Jne")]) == 2
    err = _human(capsys)
    assert "no\\x1b[2Jne" in err and err.count("\n") == 1


def test_consolidate_messages_escape_input_paths(tmp_path, capsys):
    src = tmp_path / "ck\x1b]0;pwned\x07pt.safetensors"  # sets a terminal's title
    save_file({"w": np.ones(3, np.float32)}, str(src))
    assert main(["consolidate", str(src), str(tmp_path / "out"), "--verify"]) == 0
    assert "ck\\x1b]0;pwned\\x07pt.safetensors" in _human(capsys)
