"""``plan --model`` reads its model description strictly (issue 30, item 10): a non-integral
number where an integer goes is refused naming the key (it was truncated: hidden_size
4096.5 planned as 4096), so is a bool; a FIFO or a device is refused at once (a FIFO
blocked plan forever); NaN, Infinity and duplicate keys are refused naming the key."""

import json
import os
import struct

import pytest

from offload_engine.cli.main import main
from offload_engine.plan.model_shapes import ModelInputError, load_model

from helpers.alarm_deadline import alarm_within

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 128, "vocab_size": 1000}


def _plan_error(capsys, path, *words):
    with alarm_within(20):
        rc = main(["plan", "--model", str(path), "--world-size", "8"])
    out, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, (rc, err)
    for w in (str(path), *words):
        assert w in err, err
    return err


@pytest.mark.parametrize("key, value", [("hidden_size", 4096.5), ("num_hidden_layers", 2.25),
                                        ("vocab_size", True), ("num_attention_heads", False),
                                        ("intermediate_size", "128"), ("head_dim", 16.5)])
def test_a_number_that_is_not_an_integer_is_refused_naming_its_key(tmp_path, capsys, key, value):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, key: value}))
    _plan_error(capsys, path, key)


def test_an_integral_float_is_the_integer(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "hidden_size": 64.0}))
    as_float = load_model(str(path))
    path.write_text(json.dumps(LLAMA))
    assert [t.shape for t in as_float.tensors] == [t.shape for t in load_model(str(path)).tensors]


@pytest.mark.parametrize("raw, words", [
    ('"hidden_size": NaN', ["hidden_size", "NaN"]),
    ('"hidden_size": Infinity', ["hidden_size", "Infinity"]),
    ('"hidden_size": 64, "hidden_size": 4096', ["hidden_size", "twice"]),
])
def test_non_json_numbers_and_duplicate_keys_are_refused_naming_the_key(tmp_path, capsys, raw,
                                                                         words):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA).replace('"hidden_size": 64', raw))
    _plan_error(capsys, path, *words)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "shapes.json"])
def test_a_fifo_is_refused_at_once(tmp_path, capsys, name):
    fifo = tmp_path / name
    os.mkfifo(fifo)
    _plan_error(capsys, fifo, "FIFO")


def test_a_fifo_among_a_folders_safetensors_is_refused(tmp_path, capsys):
    raw = json.dumps({"w": {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 32]}}).encode()
    (tmp_path / "a.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(32))
    os.mkfifo(tmp_path / "b.safetensors")
    _plan_error(capsys, tmp_path, "b.safetensors", "FIFO")


def test_dev_zero_is_refused(capsys):
    with pytest.raises(ModelInputError, match="character device"), alarm_within(20):
        load_model("/dev/zero")



def test_a_mesh_file_is_read_strictly(tmp_path, capsys):
    model = tmp_path / "config.json"
    model.write_text(json.dumps(LLAMA))
    mesh = tmp_path / "mesh.json"
    for text, word in (('{"data_parallel_shard_degree": NaN}', "NaN"),
                       ('{"parallelism": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested")):
        mesh.write_text(text)
        rc = main(["plan", "--model", str(model), "--world-size", "8", "--mesh", str(mesh)])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and str(mesh) in err and word in err, (rc, err)
