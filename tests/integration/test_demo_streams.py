"""The demo says its optimizer state streams through a pool: it does, for every preset."""

import pytest

from offload_engine.demo.model import PRESETS, build_model
from offload_engine.demo.pool import demo_pool, state_bytes
from offload_engine.demo.train import TrainConfig, launch


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("world_size", [1, 2])
def test_each_presets_pool_is_smaller_than_a_ranks_state(preset, world_size):
    pool = demo_pool(preset, world_size)
    assert pool.cpu_budget < state_bytes(build_model(preset)) // world_size


@pytest.mark.multiprocess
@pytest.mark.parametrize("preset", ["tiny", "moe"])
def test_a_tiny_presets_steps_read_and_write_state_on_nvme(tmp_path, preset):
    """The per-step records rank 0 reports: every step after the first reads state back
    from NVMe and writes it there (the first writes what it created)."""
    run = launch(TrainConfig(store_dir=str(tmp_path), model=preset, world_size=2, steps=3),
                 timeout_s=240)
    recs = run["records"]
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(r["written"] > 0 for r in recs), recs
    assert all(r["read"] > 0 for r in recs[1:]), recs
