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
