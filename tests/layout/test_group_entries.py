"""A shard table parsed member by member (``iter_attribute_members``) is the table
``json.loads`` parses, and a damaged file is refused naming it: a reader of 100,000-tensor
tables relies on getting the same shards and the same refusals while never holding the
whole table."""

from __future__ import annotations

import json
import os

import pytest

from offload_engine.layout import create_group
from offload_engine.layout.group_entries import iter_attribute_members
from offload_engine.layout.metadata import MetadataError, NodeNotFoundError, metadata_path


def _table(n: int) -> dict:
    return {f"layer.{i}.w": {"row_start": 0, "rows": i % 5, "numel": 3 * (i % 5),
                             "states": {"param": {"array": "rank0/param", "offset": 7 * i}},
                             "note": [1.5, None, True, "é\"\\"]} for i in range(n)}


def _write_raw(path, text: str) -> None:
    os.makedirs(path, exist_ok=True)
    with open(metadata_path(path), "w", encoding="utf-8") as f:
        f.write(text)


@pytest.mark.parametrize("n", [0, 1, 257])
def test_members_are_what_json_loads_reads(tmp_path, n):
    table = _table(n)
    create_group(tmp_path / "g", attributes={"before": {"x": 1}, "shards": table, "after": [2]})
    got = list(iter_attribute_members(tmp_path / "g", "shards"))
    assert got == list(table.items())


def test_members_of_a_pretty_printed_document(tmp_path):
    doc = {"zarr_format": 3, "node_type": "group", "attributes": {"shards": _table(5)}}
    _write_raw(tmp_path / "g", json.dumps(doc, indent=3))
    assert dict(iter_attribute_members(tmp_path / "g", "shards")) == _table(5)


@pytest.mark.parametrize("text, words", [
    ('{"zarr_format":3,"node_type":"group","attributes":{"shards":{"a":1,"a":2}}}',
     "'a' appears twice"),
    ('{"zarr_format":3,"node_type":"group","attributes":{"shards":{"a":{"rows":1', "not valid JSON"),
    ('{"zarr_format":3,"node_type":"group","attributes":{"shards":{"a":1}}} x', "extra data"),
    ('{"zarr_format":2,"node_type":"group","attributes":{"shards":{}}}', "zarr_format 2"),
    ('{"zarr_format":3,"node_type":"array","attributes":{"shards":{}}}', "node_type 'array'"),
    ('{"zarr_format":3,"node_type":"group","attributes":{"other":{}}}', "no 'shards' object"),
    ('{"zarr_format":3,"node_type":"group","attributes":{"shards":[]}}', "must be a JSON object"),
    ('{"zarr_format":3,"node_type":"group","attributes":{"shards":{"a" 1}}}', "expected ':'"),
    ('{"zarr_format":3,"node_type":"group","attributes":{"shards":{"a":1 "b":2}}}', "expected ','"),
])
def test_damaged_documents_are_refused_naming_the_file(tmp_path, text, words):
    _write_raw(tmp_path / "g", text)
    with pytest.raises(MetadataError) as e:
        list(iter_attribute_members(tmp_path / "g", "shards"))
    assert words in str(e.value) and metadata_path(tmp_path / "g") in str(e.value)


def test_a_missing_group_is_not_found(tmp_path):
    with pytest.raises(NodeNotFoundError):
        list(iter_attribute_members(tmp_path / "none", "shards"))
