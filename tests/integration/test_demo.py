"""The README's main job, at a tiny size: train, crash, resume, compare, consolidate."""

import os

import pytest

from offload_engine.cli.main import main as cli_main


@pytest.mark.multiprocess
def test_demo_runs_end_to_end_at_a_tiny_size(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["demo", "--model", "tiny", "--steps", "6", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "LR schedule, data sampler and RNG states (dropout) restored" in out
    assert "losses bitwise equal to the killed run's" in out
    assert "equals the uninterrupted run bit for bit" in out
    assert "verified: every tensor" in out
    assert "demo finished" in out
    assert not [p for p in os.listdir(tmp_path) if p.startswith("offload-engine-demo-")]  # cleaned up
