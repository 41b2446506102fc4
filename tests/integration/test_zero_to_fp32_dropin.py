"""A script written against DeepSpeed's zero_to_fp32 Python API, with only its import line
changed, prints and writes what it did under DeepSpeed 0.19.8.

``tests/fixtures/zero_to_fp32_api/user_script.py`` imports from
``deepspeed.utils.zero_to_fp32``; each ``deepspeed_*.txt`` beside it is its standard output
when run with DeepSpeed's own module (README.md there says how). Here the import line is
rewritten to ``offload_engine.consolidate`` and nothing else, and the outputs compared line
for line: names, shapes, dtypes, devices, ties, SHA-256 of every tensor (eager, lazy,
``torch.load`` of the written file, the model loaded in place) and of every file written.
"""

import os
import subprocess
import sys

import pytest

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
API = os.path.join(FIXTURES, "zero_to_fp32_api")
DEEPSPEED_IMPORT = "from deepspeed.utils.zero_to_fp32 import"
# What DeepSpeed itself prints on stdout besides the script's own lines.
DEEPSPEED_CHATTER = ("Processing zero checkpoint", "Parsing checkpoint created",
                     "Detected checkpoint of type", "Reconstructed ")


def _run_migrated(tmp_path, checkpoint: str) -> list[str]:
    with open(os.path.join(API, "user_script.py")) as f:
        lines = f.read().splitlines(keepends=True)
    changed = [i for i, line in enumerate(lines) if line.startswith(DEEPSPEED_IMPORT)]
    assert len(changed) == 1
    lines[changed[0]] = lines[changed[0]].replace(DEEPSPEED_IMPORT,
                                                  "from offload_engine.consolidate import")
    script = tmp_path / "user_script.py"
    script.write_text("".join(lines))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, str(script), os.path.join(FIXTURES, checkpoint),
                           str(tmp_path / "out"), "global_step2"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def _recorded(name: str) -> list[str]:
    with open(os.path.join(API, name)) as f:
        return [line for line in f.read().splitlines() if not line.startswith(DEEPSPEED_CHATTER)]


def _section(lines: list[str], title: str) -> list[str]:
    """The lines of section ``title`` (a line without indent) up to the next one."""
    start = lines.index(title)
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" ")),
               len(lines))
    return lines[start:end]


@pytest.mark.multiprocess
def test_hugging_face_zero3_run_is_identical_to_deepspeed(tmp_path):
    """A GPT-2 trained under ZeRO-3 (2 ranks, tied embeddings): every line the script prints
    matches, the .bin files (single and sharded) and the index byte for byte. The one
    exception is where DeepSpeed fails: safetensors with a tied weight, which DeepSpeed 0.19.8
    refuses ("Some tensors share memory") and the drop-in writes with the tie recorded."""
    ours = _run_migrated(tmp_path, "deepspeed_hf/gpt2_zero3_w2_tied")
    theirs = _recorded("deepspeed_gpt2_zero3_w2_tied.txt")
    st = next(i for i, line in enumerate(theirs) if line.startswith("safetensors: RuntimeError"))
    theirs_rest = theirs[:st] + [line for line in theirs[st + 1:] if not line.startswith("   ")]
    ours_st = _section(ours, "safetensors:")
    i = ours.index("safetensors:")
    assert ours[:i] + ours[i + len(ours_st):] == theirs_rest
    assert [line.split()[1] for line in ours_st[1:]] == ["model.safetensors"]

    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "st" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt", "lm_head.weight": "transformer.wte.weight"}
        assert "lm_head.weight" not in f.keys() and len(list(f.keys())) == 28


@pytest.mark.multiprocess
def test_zero2_bf16_run_matches_deepspeed_and_its_safetensors_byte_for_byte(tmp_path):
    """ZeRO-2, bf16 (a float buffer cast to fp32), no tie: every tensor, the index and the
    safetensors file as DeepSpeed wrote them. DeepSpeed's .bin files hold each whole flat
    fp32 group per parameter (its tensors are views into it and torch.save writes whole
    storages: 7808 bytes of storage for a 2368-byte embedding); ours hold the tensors only,
    so only those files' hashes differ, and the torch.load section shows the same tensors."""
    ours = _run_migrated(tmp_path, "deepspeed_import/zero2_w2_bf16_adamw")
    theirs = _recorded("deepspeed_zero2_w2_bf16_adamw.txt")

    def without_bin_hashes(lines):
        return [line for line in lines if not (line.startswith("  file ") and ".bin " in line)]

    assert without_bin_hashes(ours) == without_bin_hashes(theirs)
    assert _section(ours, "safetensors:") == _section(theirs, "safetensors:")
    assert [line.split()[1] for line in _section(ours, "bin_sharded:")[1:]] == [
        line.split()[1] for line in _section(theirs, "bin_sharded:")[1:]]


@pytest.mark.multiprocess
def test_zero2_frozen_layer_and_int_buffer_match_deepspeed(tmp_path):
    """ZeRO-2 with a frozen layer (exclude_frozen_parameters), an int64 buffer that float32
    cannot hold (16777217) and a tied head: the same names, dtypes and values."""
    ours = _run_migrated(tmp_path, "deepspeed/zero2_w3_fp32")
    theirs = _recorded("deepspeed_zero2_w3_fp32.txt")
    for title in ("state_dict: dict of 9", "by tag, trainable only: dict of 7",
                  "lazy: 9 names", "torch.load: dict of 9"):
        assert _section(ours, title) == _section(theirs, title)
    index = "  index "
    assert [l for l in ours if l.startswith(index)] == [l for l in theirs if l.startswith(index)]
