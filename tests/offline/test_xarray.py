"""xarray opens our stores and checkpoints: each array has a dimension name of its own
(docs/format.md promises dimension_names for xarray; with one shared "element" of
different lengths, xarray refused every group)."""

import contextlib
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from offload_engine.checkpoint import save_checkpoint
from offload_engine.formats import open_source
from offload_engine.optim import ZeroMuon

xr = pytest.importorskip("xarray")


@contextlib.contextmanager
def trained_store_and_checkpoint(tmp_path):
    """One step of a small model with its store in ``tmp_path/state`` (flushed, still open
    while the block runs) and checkpoint ``tmp_path/ck/step-00000001``."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    store = {"nvme_paths": [str(tmp_path / "state")], "bucket_bytes": 4096,
             "cpu_budget": 64 * 4096}
    with ZeroMuon(model.named_parameters(), lr=0.02, store=store) as opt:
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        save_checkpoint(str(tmp_path / "ck"), model, opt, step=1)
        opt.store.flush(sync=True)
        yield


def test_open_datatree_of_a_store_and_a_checkpoint(tmp_path):
    torch.manual_seed(0)
    with trained_store_and_checkpoint(tmp_path):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing in the store surprises zarr-python
            live = xr.open_datatree(str(tmp_path / "state" / "rank0"), engine="zarr",
                                    consolidated=False)
        # one level per rank: rank 0's folder holds its arrays
        assert set(live.data_vars) == {"muon_momentum", "adam_exp_avg", "adam_exp_avg_sq"}
        assert live["muon_momentum"].size == 16 * 8 + 4 * 16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tree = xr.open_datatree(str(tmp_path / "ck" / "step-00000001"), engine="zarr",
                                consolidated=False)
    group = tree["rank0"]
    assert {"param", "momentum_buffer", "exp_avg", "exp_avg_sq"} <= set(group.data_vars)
    assert len(set(group.dims)) == len(group.data_vars)  # one dimension per array
    with open_source(str(tmp_path / "ck")) as src:  # the same bytes our reader returns
        t = src.tensor("0.weight")
        ours = np.empty(t.numel, dtype=np.float32)
        src.read_state("0.weight", "momentum_buffer", 0, ours)
    np.testing.assert_array_equal(group["momentum_buffer"].values[: t.numel], ours)


def test_zarr_python_walks_a_live_store_and_a_checkpoint_without_a_warning(tmp_path):
    """Every member of both, with warnings as errors: no lock file or other object zarr
    does not know sits in either (zarr-python warned about the store's lock file)."""
    zarr = pytest.importorskip("zarr")
    import offload_engine.layout  # noqa: F401  (registers bfloat16 with zarr-python)
    with trained_store_and_checkpoint(tmp_path):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for path in (tmp_path / "state" / "rank0", tmp_path / "ck" / "step-00000001"):
                members = dict(zarr.open_group(str(path), mode="r").members(max_depth=None))
                arrays = [k for k, v in members.items() if isinstance(v, zarr.Array)]
                assert len(arrays) >= 3, (path, sorted(members))
