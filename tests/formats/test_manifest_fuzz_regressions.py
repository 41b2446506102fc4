"""Crashes of our manifest parser found by tests/helpers/fuzz_readers.py, one test each."""

import os

import pytest

from offload_engine.formats.errors import CheckpointError
from offload_engine.formats.ours.tensor_table import parse_manifest
from offload_engine.layout.manifest import CHECKPOINT_FORMAT, MANIFEST_VERSION


def _attrs(**over):
    attrs = {"format": CHECKPOINT_FORMAT, "format_version": MANIFEST_VERSION, "step": 1,
             "world_size": 2, "arrays": {}, "tensors": {}, "checksums": {}, "committed": True}
    attrs.update(over)
    return attrs


@pytest.mark.parametrize("world", [2**31, 2**63, 2**64])
def test_huge_world_size_is_a_checkpoint_error(world):
    # world_size 2**31 made the parser list 2**31 ranks (MemoryError, or the OOM killer);
    # 2**63 raised OverflowError. (Worded loosely: part B's check of world_size against
    # the arrays gives its own message.)
    where = os.path.join("gen", "zarr.json")
    with pytest.raises(CheckpointError, match=rf"gen/zarr\.json: '?world_size'? is {world}"):
        parse_manifest(_attrs(world_size=world), "checkpoint", where)
