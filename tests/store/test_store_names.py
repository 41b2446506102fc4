"""An array name is a path inside the store directory (issue 30, item 4): ``register``
refuses every name the manifest's readers refuse, so nothing is written outside the
directory and the manifest never holds a name that ``stale_store="discard"`` could not
clean."""

import os

import pytest
import torch

from helpers.store_runs import make_store
from offload_engine.errors import InputError
from offload_engine.layout.member_paths import name_problem


@pytest.mark.parametrize("name", ["../escape", "a/../../escape", "rank0/../../x", "./m",
                                  "a//b", "m/", "/abs", "a/./b", ".."])
def test_register_refuses_names_that_leave_or_bend_the_directory(tmp_path, name):
    root = tmp_path / "store"
    root.mkdir()
    store = make_store(root)
    try:
        with pytest.raises(InputError, match="array name"):
            store.register(name, torch.float32, 4096)
        assert sorted(os.listdir(tmp_path)) == ["store"]  # nothing written beside it
        assert name not in store.arrays()
    finally:
        store.close()


def test_every_name_register_accepts_is_one_the_readers_accept(tmp_path):
    """The store's rule and the readers' rule agree on the names people use."""
    store = make_store(tmp_path)
    try:
        for name in ["m", "rank0/muon_momentum", "layers.0.w-q_proj", "a/b/c.d"]:
            store.register(name, torch.float32, 1024)
            assert name_problem(name) is None
    finally:
        store.close()
