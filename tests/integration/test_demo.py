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


@pytest.mark.multiprocess
def test_demo_trains_a_mixture_of_experts_on_muon_and_resumes_bitwise(tmp_path, capsys, monkeypatch):
    """`demo --model moe`: grouped expert stacks (4 experts, top-2 router) on Muon, one matrix
    per expert, sharded by FSDP2 over 2 processes; crash, resume and consolidation as for the
    dense model."""
    monkeypatch.chdir(tmp_path)
    assert cli_main(["demo", "--model", "moe", "--steps", "6", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "24 of them experts" in out          # 2 layers x 3 stacks x 4 experts
    assert "losses bitwise equal to the killed run's" in out
    assert "equals the uninterrupted run bit for bit" in out
    assert "verified: every tensor" in out
    assert "demo finished" in out
