"""safetensors headers with impossible shapes are refused before their sizes are multiplied."""

import json
import struct

import pytest

from offload_engine.formats.errors import FormatError
from offload_engine.formats.safetensors import read_header


def _write(path, shape, offsets):
    raw = json.dumps({"w": {"dtype": "F32", "shape": shape, "data_offsets": offsets}}).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offsets[1]))
    return str(path)


@pytest.mark.parametrize("shape", [[1] * 65, [2**63]])
def test_shape_beyond_torchs_limits_is_refused(tmp_path, shape):
    path = _write(tmp_path / "x.safetensors", shape, [0, 4])
    with pytest.raises(FormatError, match=r"x\.safetensors: tensor 'w' has a malformed shape .*at most 64"):
        read_header(path)


def test_shape_at_the_limits_reads(tmp_path):
    path = _write(tmp_path / "ok.safetensors", [1] * 64, [0, 4])
    entries, _, _ = read_header(path)
    assert entries["w"].shape == (1,) * 64


def test_header_of_many_tiny_json_values_is_refused_before_parsing(tmp_path):
    # 3 million empty objects (9 MB of header) would build ~200 MB of Python objects;
    # a 100 MB header of them, 2.4 GB
    from offload_engine.formats.safetensors import MAX_JSON_VALUES
    raw = b'{"__metadata__": {"x": [' + b"{}," * (MAX_JSON_VALUES + 10) + b'{}]}}'
    path = tmp_path / "many.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(FormatError, match=rf"many\.safetensors: the header: about \d+ JSON values; "
                                          rf"at most {MAX_JSON_VALUES} are read"):
        read_header(str(path), check_data=False)


def test_index_of_many_tiny_json_values_is_refused_before_parsing(tmp_path):
    from offload_engine.formats.safetensors import MAX_JSON_VALUES, read_index
    path = tmp_path / "model.safetensors.index.json"
    path.write_bytes(b'{"weight_map": {}, "x": [' + b"[]," * (MAX_JSON_VALUES + 10) + b"[]]}")
    with pytest.raises(FormatError, match=r"model\.safetensors\.index\.json: about \d+ JSON values"):
        read_index(str(path))
