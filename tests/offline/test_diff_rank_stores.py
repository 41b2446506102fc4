"""`diff STORE CKPT` and `diff STORE STORE` for a store of two ranks (a folder per rank, each
holding its own rows): whole tensors compared, as for a one-rank store; ranks missing or
from different steps or runs refused with one line (exit 2).

One real run at world size 2 (gloo, two spawned processes) serves every test: two stores
of the same model and gradients, one stopped after 3 steps, one after 4, and a checkpoint
of each step."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from offload_engine.checkpoint import save_checkpoint
from offload_engine.cli.main import main as cli_main
from helpers.checkpoint_runs import mixed_model, step_both
from helpers.zero_muon_harness import MIXED_SHAPES, spawn

pytestmark = pytest.mark.multiprocess


def _train(rank, world, mesh, tmp):
    """Two optimizers on the same model and gradients: "three" stops after step 3, "four"
    after step 4; the checkpoint folder gets a generation of each step."""
    for name, steps in (("three", 3), ("four", 4)):
        model, ref, opt, ref_opts = mixed_model(mesh, 3, os.path.join(tmp, name))
        step_both(model, ref, opt, ref_opts, range(steps), rank, world)
        save_checkpoint(os.path.join(tmp, "ck"), model, opt, steps)
        opt.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rank_stores")
    spawn(2, _train, str(tmp))
    assert sorted(os.listdir(tmp / "four")) == ["rank0", "rank1"]
    return tmp


def _diff(capsys, *argv) -> tuple[int, dict]:
    capsys.readouterr()
    rc = cli_main(["diff", *map(str, argv), "--json"])
    return rc, json.loads(capsys.readouterr().out)


def _counts(report) -> dict:
    return {(v["name"], v["state"]): v["count"] for v in report["values"]}


def test_store_of_two_ranks_equals_the_checkpoint_of_its_step(run, capsys):
    rc, report = _diff(capsys, run / "four", run / "ck", "--generation-b", "step-00000004")
    assert rc == 0 and report["equal"], report
    assert not report["added"] and not report["removed"] and not report["changed"]
    counts = _counts(report)
    # whole tensors: both ranks' rows (w_big: rows [0, 48) on rank 0, [48, 96) on rank 1)
    assert counts[("w_big", "momentum_buffer")] == 96 * 64
    assert counts[("embed_tokens", "exp_avg")] == 11 * 6
    assert {s for _, s in counts} == {"momentum_buffer", "exp_avg", "exp_avg_sq"}
    assert len({n for n, _ in counts}) == len(MIXED_SHAPES)


def test_store_of_two_ranks_differs_from_the_checkpoint_of_the_step_before(run, capsys):
    rc, report = _diff(capsys, run / "four", run / "ck", "--generation-b", "step-00000003")
    assert rc == 1 and not report["equal"]
    assert ("w_big", "momentum_buffer") in {(v["name"], v["state"]) for v in report["values"]
                                            if not v["equal"]}
    capsys.readouterr()
    assert cli_main(["diff", str(run / "four"), str(run / "ck"), "--generation-b",
                     "step-00000003"]) == 1
    out = capsys.readouterr().out
    assert "w_big" in out and "momentum_buffer" in out and "different:" in out


def test_two_stores_of_two_ranks(run, capsys):
    rc, report = _diff(capsys, run / "three", run / "ck", "--generation-b", "step-00000003")
    assert rc == 0 and report["equal"], report
    rc, report = _diff(capsys, run / "three", run / "three")
    assert rc == 0 and report["equal"]
    rc, report = _diff(capsys, run / "three", run / "four")
    assert rc == 1 and {v["name"] for v in report["values"] if not v["equal"]} >= {"w_big"}


def test_one_value_changed_in_rank_1_is_found_in_its_tensor_alone(run, tmp_path, capsys):
    import zarr

    from offload_engine.formats.ours.reader import OursSource

    store = tmp_path / "four"
    shutil.copytree(run / "four", store)
    with OursSource(str(store / "rank1"), "store") as rank1:
        p = rank1.placements()[("w_big", "momentum_buffer")][0]
    array = zarr.open_array(str(store / "rank1" / p.array), mode="r+")
    array[p.offset + 5] = array[p.offset + 5] + 1.0
    rc, report = _diff(capsys, store, run / "ck", "--generation-b", "step-00000004")
    assert rc == 1
    bad = [v for v in report["values"] if not v["equal"]]
    assert [(v["name"], v["state"], v["mismatches"]) for v in bad] == [
        ("w_big", "momentum_buffer", 1)]


def test_a_missing_rank_is_named(run, tmp_path, capsys):
    store = tmp_path / "four"
    shutil.copytree(run / "four" / "rank0", store / "rank0")
    capsys.readouterr()
    assert cli_main(["diff", str(store), str(run / "ck")]) == 2
    err = capsys.readouterr().err
    assert "rank(s) 1 missing" in err and "world size 2" in err and err.count("\n") == 1


def test_ranks_at_different_steps_are_refused(run, tmp_path, capsys):
    store = tmp_path / "mixed"
    shutil.copytree(run / "four" / "rank0", store / "rank0")
    shutil.copytree(run / "three" / "rank1", store / "rank1")
    capsys.readouterr()
    assert cli_main(["diff", str(store), str(run / "ck")]) == 2
    err = capsys.readouterr().err
    assert "different steps (rank0 step 4, rank1 step 3)" in err and err.count("\n") == 1


def test_a_rank_of_another_run_is_refused(run, tmp_path, capsys):
    """Same step, another run (its parameters in bfloat16): rank 1's tensor table differs
    from rank 0's."""
    store = tmp_path / "other"
    shutil.copytree(run / "four", store)
    path = store / "rank1" / "zarr.json"
    doc = json.loads(path.read_text())
    doc["attributes"]["tensors"]["w_big"]["dtype"] = "bfloat16"
    path.write_text(json.dumps(doc))
    capsys.readouterr()
    assert cli_main(["diff", str(store), str(run / "ck")]) == 2
    err = capsys.readouterr().err
    assert "different runs" in err and "'w_big'" in err, err


# -- tensor parallel: each rank holds a box (columns), replicated tensors on both ------------------
def _train_tp(rank, world, mesh, tmp):
    import torch

    from offload_engine.optim import ZeroMuon
    from helpers.checkpoint_runs import ADAMW, MUON, store
    from helpers.zero_muon_meshes import tp

    model, _ = tp(mesh, 3)
    opt = ZeroMuon(model.named_parameters(), **MUON, adamw=ADAMW,
                   store=store(os.path.join(tmp, "live")))
    for step in range(2):
        for p in model.parameters():
            p.grad = torch.ones_like(p) * (0.01 * (step + 1)) + p.detach() * 0.1
        opt.step()
    save_checkpoint(os.path.join(tmp, "ck"), model, opt, 2)
    opt.close()


def test_boxes_of_a_tensor_parallel_store_put_together(tmp_path, capsys):
    """big.weight is Shard(1): rank 1 holds columns [32, 64) of every row, 96 runs of the
    flat tensor; norm.weight is replicated (both ranks hold it whole)."""
    import zarr

    from offload_engine.formats.ours.reader import OursSource

    spawn(2, _train_tp, str(tmp_path))
    live, ck = tmp_path / "live", tmp_path / "ck"
    doc = json.loads((live / "rank1" / "zarr.json").read_text())["attributes"]["tensors"]
    assert doc["big.weight"]["boxes_per_rank"] == [[[0, 0], [96, 32]], [[0, 32], [96, 32]]]
    rc, report = _diff(capsys, live, ck)
    assert rc == 0 and report["equal"], report
    counts = _counts(report)
    assert counts[("big.weight", "momentum_buffer")] == 96 * 64
    assert counts[("norm.weight", "exp_avg")] == 8

    with OursSource(str(live / "rank1"), "store") as rank1:
        p = rank1.placements()[("big.weight", "momentum_buffer")][0]
    array = zarr.open_array(str(live / "rank1" / p.array), mode="r+")
    array[p.offset + 40] = array[p.offset + 40] + 1.0   # row 1, column 32 + 8
    rc, report = _diff(capsys, live, ck)
    assert rc == 1
    assert [(v["name"], v["mismatches"]) for v in report["values"] if not v["equal"]] == [
        ("big.weight", 1)]


def test_a_forged_world_size_is_refused_at_once(run, tmp_path, capsys):
    """A world size of 10**12 in both manifests: the first few missing ranks are named,
    never all of them counted."""
    store = tmp_path / "forged"
    shutil.copytree(run / "four", store)
    for r in range(2):
        path = store / f"rank{r}" / "zarr.json"
        doc = json.loads(path.read_text())
        doc["attributes"]["world_size"] = 10**12
        path.write_text(json.dumps(doc))
    capsys.readouterr()
    assert cli_main(["diff", str(store), str(run / "ck")]) == 2
    err = capsys.readouterr().err
    assert "rank(s) 2, 3, 4, ... missing" in err and err.count("\n") == 1, err
