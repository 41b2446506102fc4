"""A group written as it is produced (``write_group_streamed``) is byte for byte the group
``create_group`` writes for the same attributes: readers (our checkpoints' reader, the
seal's check, zarr-python) cannot tell them apart, and a table of 100,000 entries is never
held whole."""

from __future__ import annotations

import math
import os

import pytest

from offload_engine.errors import InputError
from offload_engine.layout import create_group, read_group
from offload_engine.layout.group_stream import FLUSH_BYTES, Streamed, write_group_streamed
from offload_engine.layout.metadata import metadata_path


def _whole(value):
    """``value`` with every Streamed made the dict or list it stands for."""
    if isinstance(value, Streamed):
        items = list(value.members)
        return {k: _whole(v) for k, v in items} if value.is_object else [_whole(v) for v in items]
    if isinstance(value, dict):
        return {k: _whole(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole(v) for v in value]
    return value


def _cases(n: int):
    """Attributes with streamed members at the top and nested, as the import writes them."""
    def table():
        for i in range(n):
            yield f"layers.{i}.experts.w\u00e9", {"shape": [i % 7, 16], "dtype": "float32",
                                                   "states": {"param": "float32"}, "adam_step": 2.0}
    return [
        {},
        {"shards": Streamed.object(iter(()))},
        {"shards": Streamed.object(table())},
        {"format": "offload-engine-checkpoint", "tensors": Streamed.object(table()),
         "imported": {"param_groups": [{"lr": 1e-3}], "disagreements": Streamed.array(
             {"name": f"t{i}", "deepspeed": "adamw", "default": "muon"} for i in range(n))},
         "arrays": {"rank0/param": {"dtype": "float32", "numel": 3}}, "committed": True},
    ]


@pytest.mark.parametrize("sealed", [False, True])
@pytest.mark.parametrize("case", range(4))
def test_streamed_group_is_create_groups_bytes(tmp_path, sealed, case):
    n = 30_000  # several flushes of FLUSH_BYTES
    streamed, whole = tmp_path / "streamed", tmp_path / "whole"
    size = write_group_streamed(streamed, _cases(n)[case], sealed=sealed)
    create_group(whole, _whole(_cases(n)[case]), sealed=sealed)
    got = open(metadata_path(streamed), "rb").read()
    assert got == open(metadata_path(whole), "rb").read()
    assert size == len(got) and (case < 2 or size > FLUSH_BYTES)
    assert read_group(streamed, verify_seal=True) == read_group(whole)
    assert [n for n in os.listdir(streamed)] == ["zarr.json"]  # no temporary file left


def test_a_value_json_cannot_hold_fails_naming_the_group_and_leaves_nothing(tmp_path):
    rows = Streamed.object((f"t{i}", {"adam_step": math.nan if i == 50_000 else 1.0})
                           for i in range(60_000))
    with pytest.raises(InputError, match="streamed.*not JSON-serialisable"):
        write_group_streamed(tmp_path / "streamed", {"tensors": rows})
    assert os.listdir(tmp_path / "streamed") == []  # neither zarr.json nor its temporary file
