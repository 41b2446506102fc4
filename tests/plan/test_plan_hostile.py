"""``plan --model`` on hostile model descriptions: huge or malformed numbers give a
one-line error (exit 2) before anything proportional to them is built, or a correct plan
computed with Python ints."""

import json
import struct

import pytest

from offload_engine.cli.main import main
from offload_engine.plan import model_limits
from offload_engine.plan.model_shapes import load_model

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 128, "vocab_size": 1000}


def _safetensors(path, shape):
    raw = json.dumps({"w": {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]}}).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    return path


def _json(path, doc):
    path.write_text(json.dumps(doc))
    return path


def _plan_error(capsys, path, *extra):
    rc = main(["plan", "--model", str(path), "--world-size", "8", *extra])
    out, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, (rc, err)
    assert str(path) in err
    return err


def test_huge_vocab_is_refused_by_bucket_count(tmp_path, capsys):
    path = _json(tmp_path / "config.json", {**LLAMA, "hidden_size": 4096, "vocab_size": 10**12})
    err = _plan_error(capsys, path)
    assert f"the planner lays out at most {model_limits.MAX_PLAN_BUCKETS}" in err


def test_huge_safetensors_shape_is_refused(tmp_path, capsys):
    path = _safetensors(tmp_path / "big.safetensors", [10**15, 10**15])
    err = _plan_error(capsys, path)
    assert "buckets" in err


def test_shape_list_size_beyond_int64_is_refused(tmp_path, capsys):
    path = _json(tmp_path / "shapes.json", {"a": [4, 4], "b": [2**70]})
    err = _plan_error(capsys, path)
    assert "'b': shape must have at most 64 sizes, each an integer in [0, 2**63)" in err


def test_shape_of_too_many_dimensions_is_refused(tmp_path, capsys):
    path = _json(tmp_path / "shapes.json", {"a": [1] * 65})
    _plan_error(capsys, path)


def test_layer_count_is_checked_before_the_list_is_built(tmp_path, capsys):
    layers = model_limits.MAX_TENSORS // 18 + 1
    path = _json(tmp_path / "config.json", {**LLAMA, "num_hidden_layers": layers})
    err = _plan_error(capsys, path)
    assert f"{layers} layers" in err and f"at most {model_limits.MAX_TENSORS} tensors" in err


@pytest.mark.parametrize("value", [float("inf"), -1, "many", 10**30])
def test_config_number_not_an_int64_is_refused(tmp_path, capsys, value):
    doc = json.dumps({**LLAMA, "vocab_size": 0}).replace('"vocab_size": 0',
                                                          f'"vocab_size": {json.dumps(value)}')
    path = tmp_path / "config.json"
    path.write_text(doc.replace("Infinity", "1e999"))
    err = _plan_error(capsys, path)
    assert "vocab_size" in err


def test_json_number_of_many_digits_is_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "shapes.json"
    path.write_text('{"a": [' + "9" * 5000 + "]}")
    _plan_error(capsys, path)


def test_big_model_with_big_buckets_plans_with_python_ints(tmp_path, capsys):
    # 10**18 parameters: planned (within the bucket cap) without overflow
    path = _safetensors(tmp_path / "big.safetensors", [10**9, 10**9])
    rc = main(["plan", "--model", str(path), "--world-size", "8", "--bucket-bytes", str(10**15), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert load_model(str(path)).numel == 10**18
