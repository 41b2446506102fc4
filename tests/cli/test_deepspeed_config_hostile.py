"""``config from-deepspeed`` on hostile DeepSpeed configs (issue 30, item 6): every one ends
in a one-line error naming the file (and the key) with exit 2, or in a translation whose
output is strict JSON; never a traceback, a silent clamp, a NaN written out or a hang."""

import json
import os

import pytest

from offload_engine.cli.main import main

from helpers.alarm_deadline import alarm_within

MUON = {"optimizer": {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95}},
        "zero_optimization": {"stage": 3, "sub_group_size": 1e9,
                              "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme",
                                                    "buffer_count": 4}},
        "aio": {"block_size": 1048576, "queue_depth": 8}}


@pytest.fixture
def deadline():
    with alarm_within(20):
        yield


def _with(path: str, raw: str) -> str:
    """MUON with the value at dotted ``path`` replaced by the raw JSON text ``raw``."""
    doc = json.loads(json.dumps(MUON))
    node = doc
    *parents, last = path.split(".")
    for p in parents:
        node = node[p]
    node[last] = "@@"
    return json.dumps(doc).replace('"@@"', raw)


def _run(capsys, path, *extra):
    rc = main(["config", "from-deepspeed", str(path), "--json", *extra])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return rc, out, err


def _refused(capsys, path, *words):
    rc, out, err = _run(capsys, path)
    assert rc == 2 and err.count("\n") == 1, (rc, err)
    assert str(path) in err
    for w in words:
        assert w in err, err
    return err


@pytest.mark.parametrize("key, raw, words", [
    ("optimizer.params.lr", "Infinity", ["optimizer.params.lr", "Infinity"]),
    ("optimizer.params.lr", "NaN", ["optimizer.params.lr", "NaN"]),
    ("optimizer.params.lr", "1e400", ["optimizer.params.lr"]),
    ("optimizer.params.lr", '"abc"', ["optimizer.params.lr: expected a finite number", "abc"]),
    ("optimizer.params.lr", "-0.1", ["optimizer.params.lr"]),
    ("optimizer.params.momentum", "[0.9]", ["optimizer.params.momentum"]),
    ("zero_optimization.offload_optimizer.buffer_count", "null",
     ["zero_optimization.offload_optimizer.buffer_count", "null"]),
    ("zero_optimization.offload_optimizer.buffer_count", '"4"',
     ["zero_optimization.offload_optimizer.buffer_count: expected a positive integer"]),
    ("zero_optimization.offload_optimizer.buffer_count", "4.5",
     ["zero_optimization.offload_optimizer.buffer_count", "4.5"]),
    ("zero_optimization.offload_optimizer.buffer_count", "true",
     ["zero_optimization.offload_optimizer.buffer_count"]),
    ("zero_optimization.sub_group_size", "[1000]", ["zero_optimization.sub_group_size"]),
    ("zero_optimization.sub_group_size", "9" * 4000, ["zero_optimization.sub_group_size",
                                                       "4000 digits"]),
    ("aio.block_size", "-4096", ["aio.block_size", "-4096"]),
    ("aio.block_size", "0", ["aio.block_size"]),
    ("aio.queue_depth", "-8", ["aio.queue_depth"]),
    ("aio.queue_depth", '"deep"', ["aio.queue_depth"]),
    ("zero_optimization.offload_optimizer.device", '"gpu"',
     ["zero_optimization.offload_optimizer.device", "'nvme'"]),
    ("zero_optimization.offload_optimizer.nvme_path", "5",
     ["zero_optimization.offload_optimizer.nvme_path"]),
    ("zero_optimization.stage", "7", ["zero_optimization.stage"]),
    ("aio", "[1, 2]", ["aio: expected an object"]),
    ("optimizer.params", '"fast"', ["optimizer.params: expected an object"]),
])
def test_a_bad_value_is_refused_naming_its_key(tmp_path, capsys, key, raw, words):
    path = tmp_path / "ds.json"
    path.write_text(_with(key, raw))
    _refused(capsys, path, *words)


def test_deep_nesting_and_a_whole_document_of_nonsense_are_one_line_errors(tmp_path, capsys):
    for i, raw in enumerate(["[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000,
                             "NaN", "[1, 2]", '{"optimizer": {"type": 5}}',
                             '{"aio": {"block_size": 1, "block_size": 2}}']):
        path = tmp_path / f"ds{i}.json"
        path.write_text(raw)
        _refused(capsys, path)


def test_dev_zero_is_refused_without_reading_it_whole(capsys, deadline):
    _refused(capsys, "/dev/zero", "character device")


def test_a_fifo_is_refused_at_once(tmp_path, capsys, deadline):
    fifo = tmp_path / "ds.json"
    os.mkfifo(fifo)
    _refused(capsys, fifo, "FIFO")


def test_a_config_over_the_size_cap_is_refused(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(MUON) + " " * (2 << 20))
    _refused(capsys, path, "bytes")


def test_integral_floats_and_auto_are_translated_and_the_output_is_strict_json(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(_with("optimizer.params.weight_decay", '"auto"'))
    store, optim = tmp_path / "store.json", tmp_path / "optim.json"
    rc, out, err = _run(capsys, path, "--out", str(store), "--optimizer-out", str(optim))
    assert rc == 0, err

    def strict(name):
        raise AssertionError(f"{name} in the output")
    for text in (out, store.read_text(), optim.read_text()):
        json.loads(text, parse_constant=strict)
    doc = json.loads(out)
    # sub_group_size 1e9 is the integer 10**9: 4 buffers x 10**9 elements x 4 bytes
    assert doc["store"]["cpu_budget"] >= 4 * 10**9 * 4
    assert doc["optimizer"]["lr"] == 0.02 and "weight_decay" not in doc["optimizer"]
    assert any(r["key"] == "optimizer.params.weight_decay" and r["status"] == "ignored"
               for r in doc["report"])


def test_a_key_with_control_characters_is_printed_escaped(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**MUON, "\x1b[2Jevil": 1}))
    assert main(["config", "from-deepspeed", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\u001b[2Jevil" in out


def test_the_store_config_it_writes_is_read_back_strictly(tmp_path):
    """StoreConfig.from_file (what --out is loaded with) reads the same strict JSON."""
    from offload_engine.errors import InputError
    from offload_engine.store.config import StoreConfig

    path = tmp_path / "store.json"
    path.write_text('{"cpu_budget": 1048576, "acquire_timeout_s": NaN}')
    with pytest.raises(InputError, match="acquire_timeout_s: NaN"):
        StoreConfig.from_file(str(path))
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="FIFO"), alarm_within(20):
        StoreConfig.from_file(str(fifo))
