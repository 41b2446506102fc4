"""Fuzz of the config and cache readers (issue 30, Must-show: the fuzz suites extended to
config from-deepspeed, plan --model and the device-profile cache). Hundreds of hostile
documents per entry point, from a fixed seed (tests/helpers/hostile_json.py): every leaf of a
real document replaced by each hostile value (NaN, Infinity, 1e400, null, lists, strings,
bools, negative and non-integral numbers, a 4,000-digit integer, 100,000 nested arrays,
escapes, lone surrogates...), attacks on the whole document, and random byte mutations.

Each case either works or is refused: the command line exits 0 (its JSON output strict) or 2
with one line naming the file, never a traceback (exit 70); the cache reader returns a
usable profile or None, never raises. Failures are collected and reported by case name."""

import json
import os

import pytest

from offload_engine.cli.main import main
from offload_engine.formats.errors import FormatError
from offload_engine.io import device_profile as dp
from offload_engine.offline.ds_import import model_dtype

from helpers.hostile_json import document_cases, mutations, sample, structured_cases
from helpers.paths import FIXTURES

SEED = 20261204
DS_CONFIG = os.path.join(FIXTURES, "deepspeed_configs", "zero3_nvme_muon.json")
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
         "vocab_size": 1000, "tie_word_embeddings": False}
SHAPES = [{"name": "w", "shape": [64, 64]}, {"name": "b", "shape": [64], "dtype": "float32"}]


def _strict(name):
    raise AssertionError(f"non-JSON constant {name} in the output")


def _cli_cases(tmp_path, capsys, cases, argv_of, check_output=True) -> list[str]:
    """Run the command on every case; the names of those that broke the rules."""
    bad = []
    path = tmp_path / "input.json"
    for name, raw in cases:
        path.write_bytes(raw)
        rc = main(argv_of(str(path)))
        out, err = capsys.readouterr()
        if rc == 0:
            if check_output:
                try:
                    json.loads(out, parse_constant=_strict)
                except (ValueError, AssertionError) as e:
                    bad.append(f"{name}: exit 0 with output that is not strict JSON ({e})")
        elif rc != 2 or "Traceback" in err or err.count("\n") != 1 or str(path) not in err:
            bad.append(f"{name}: exit {rc}: {err[-600:]!r}")
    return bad


def _report(bad: list[str], total: int) -> None:
    assert not bad, f"{len(bad)} of {total} cases broke the rules:\n" + "\n".join(bad[:20])


def test_config_from_deepspeed(tmp_path, capsys):
    with open(DS_CONFIG) as f:
        base = json.load(f)
    cases = (sample(structured_cases(base), 600, SEED) + document_cases(base)
             + mutations(base, 200, SEED))
    bad = _cli_cases(tmp_path, capsys, cases,
                     lambda p: ["config", "from-deepspeed", p, "--json"])
    _report(bad, len(cases))


@pytest.mark.parametrize("base", [LLAMA, SHAPES], ids=["config.json", "shape list"])
def test_plan_model(tmp_path, capsys, base):
    cases = sample(structured_cases(base), 250, SEED) + mutations(base, 100, SEED)
    bad = _cli_cases(tmp_path, capsys, cases,
                     lambda p: ["plan", "--model", p, "--world-size", "8", "--json"])
    _report(bad, len(cases))


def test_device_profile_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(dp.PROFILE_DIR_ENV, str(tmp_path / "profiles"))
    monkeypatch.setenv(dp.PROBE_ENV, "0")
    os.makedirs(tmp_path / "profiles")
    data = str(tmp_path)
    base = {"format": dp.FORMAT, "format_version": dp.FORMAT_VERSION, "key": dp.profile_key(data),
            "read": {"mode": "buffered", "queue_depth": 4, "block_bytes": 131072, "streams": 2},
            "write": {"mode": "direct", "queue_depth": 2, "block_bytes": 262144},
            "points": [{"mode": "direct", "queue_depth": 2, "block_bytes": 262144, "streams": 1,
                        "read_gbps": 1.5, "write_gbps": 0.5}],
            "measured_at": "2026-12-04T00:00:00Z"}
    cases = (sample(structured_cases(base), 600, SEED) + document_cases(base)
             + mutations(base, 200, SEED))
    file, bad = dp.profile_file(data), []
    for name, raw in cases:
        with open(file, "wb") as f:
            f.write(raw)
        dp.forget_memo()
        try:
            got = dp.load(data)
            if got is not None:  # what the store and adaptive I/O then read from it
                for op in ("read", "write"):
                    dp.settings_of(got, op)
                for p in got.get("points", []):
                    dp.DirectionSettings(p["mode"], p["queue_depth"], p["block_bytes"],
                                         "adaptive", p.get("streams", 1))
            dp.choose(data)
            dp.reader_settings(data, 4)
        except Exception as e:  # noqa: BLE001 - any exception is the bug this test looks for
            bad.append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
    _report(bad, len(cases))


def test_import_model_config(tmp_path):
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "torch_dtype": "bfloat16", "hidden_size": 64}
    cases = structured_cases(base) + mutations(base, 100, SEED)
    path, bad = tmp_path / "config.json", []
    for name, raw in cases:
        path.write_bytes(raw)
        try:
            model_dtype(str(path))
        except FormatError as e:
            if str(path) not in str(e) or "\n" in str(e):
                bad.append(f"{name}: an error that is not one line naming the file: {e}")
        except Exception as e:  # noqa: BLE001 - any other exception is a bug
            bad.append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
    _report(bad, len(cases))
