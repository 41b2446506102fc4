"""`offload-engine config from-deepspeed`: every key of a DeepSpeed config is mapped (with
its rule) or reported ignored (with its reason), and the result is a store config and
ZeroMuon arguments that work."""

import json
import os

import pytest
import torch
from torch import nn

from offload_engine.cli.main import main
from offload_engine.optim import ZeroMuon
from offload_engine.plan.deepspeed_config import leaves, translate
from offload_engine.store import StoreConfig, TieredStore
from offload_engine.units import MiB

from helpers.paths import FIXTURES

FIXTURE = os.path.join(FIXTURES, "deepspeed_configs",
                       "zero3_nvme_muon.json")

# What DeepSpeed 0.19.8 documents for optimizer-state offload and async I/O
# (runtime/zero/offload_config.py, runtime/swap_tensor/constants.py, runtime/zero/config.py)
DOCUMENTED = {
    "zero_optimization.offload_optimizer." + k for k in (
        "device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write",
        "fast_init", "ratio", "super_offload", "cpuadam_cores_perc")
} | {
    "zero_optimization.offload_param." + k for k in (
        "device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory")
} | {
    "aio." + k for k in ("block_size", "queue_depth", "intra_op_parallelism", "single_submit",
                         "overlap_events", "use_gds")
} | {"zero_optimization.sub_group_size", "zero_optimization.save_muon_momentum_buffer_in_memory"}


def fixture() -> dict:
    with open(FIXTURE) as f:
        return json.load(f)


def test_every_documented_offload_key_is_mapped_or_reported():
    ds = fixture()
    assert DOCUMENTED <= set(leaves(ds))  # the fixture holds them all
    t = translate(ds)
    reported = [r.key for r in t.report]
    assert reported == list(leaves(ds))  # every key once, in the file's order
    for r in t.report:
        assert r.status in ("mapped", "ignored") and r.rule, r
        assert r.status == "mapped" or len(r.rule) > 20, r  # a reason, not a word
        assert (r.status == "mapped") == bool(r.target), r
    by_key = {r.key: r for r in t.report}
    for key in ("zero_optimization.offload_optimizer.device", "aio.block_size", "aio.queue_depth",
                "aio.intra_op_parallelism", "zero_optimization.offload_optimizer.buffer_count",
                "zero_optimization.save_muon_momentum_buffer_in_memory", "optimizer.params.lr"):
        assert by_key[key].status == "mapped", key
    assert by_key["aio.thread_count"].status == "ignored"  # DeepSpeed 0.19.8 does not read it
    assert any("thread_count" in w for w in t.warnings)


def test_values_follow_the_rules():
    t = translate(fixture())
    s = t.store
    assert s["default_home"] == "nvme" and s["nvme_paths"] == ["/local_nvme/offload-engine"]
    # buffer_count 4 x sub_group_size 1e8 x 4 bytes, in whole 64 MiB buckets
    assert s["cpu_budget"] == -(-4 * 10**8 * 4 // (64 * MiB)) * 64 * MiB
    assert s["block_size"] == 1 << 20
    assert s["queue_depth"] == 32 and s["io_threads"] == 32  # 16 per thread x 2 threads
    assert s["homes"] == {"rank*/muon_momentum": "cpu"}
    assert t.optimizer == {"use_muon": "default", "lr": 0.02, "nesterov": True, "momentum": 0.95,
                           "weight_decay": 0.1, "master_weights": True,
                           "adamw": {"lr": 0.0003, "betas": [0.9, 0.95], "eps": 1e-8,
                                     "weight_decay": 0.1}}
    StoreConfig.load(s)  # valid as it stands


def test_adamw_cpu_offload_and_auto_values():
    t = translate({"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.999],
                                                            "weight_decay": 0.01}},
                   "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                   "train_batch_size": "auto"})
    assert t.store["default_home"] == "cpu"
    assert t.optimizer == {"use_muon": "none", "adamw": {"betas": [0.9, 0.999],
                                                         "weight_decay": 0.01}}
    lr = next(r for r in t.report if r.key == "optimizer.params.lr")
    assert lr.status == "ignored" and "auto" in lr.rule
    assert any("cpu_budget" in w for w in t.warnings)


def test_legacy_thread_count_is_translated_as_deepspeed_ran_it():
    t = translate({"aio": {"queue_depth": 8, "thread_count": 4}})
    assert t.store["queue_depth"] == 8  # DeepSpeed read intra_op_parallelism (default 1)


def test_store_patterns_place_arrays(tmp_path):
    cfg = StoreConfig.load({"nvme_paths": [str(tmp_path)], "bucket_bytes": 4096,
                            "cpu_budget": 64 * 4096,
                            "homes": {"rank0/master": "nvme", "rank*/muon_momentum": "cpu"}})
    assert cfg.home_of("rank3/muon_momentum") == "cpu"
    assert cfg.home_of("rank0/master") == "nvme" and cfg.home_of("rank0/exp_avg") == "nvme"
    with TieredStore(cfg) as store:
        assert store.register("rank0/muon_momentum", torch.float32, 1024).home == "cpu"
        assert store.register("rank0/exp_avg", torch.float32, 1024).home == "nvme"


def test_translated_config_drives_zero_muon(tmp_path, capsys):
    ds = fixture()
    ds["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path / "nvme")
    ds["zero_optimization"]["sub_group_size"] = 4096  # the smallest pool: its floor
    os.makedirs(tmp_path / "nvme")
    src = tmp_path / "ds.json"
    src.write_text(json.dumps(ds))
    store_json, optim_json = tmp_path / "store.json", tmp_path / "zeromuon.json"
    assert main(["config", "from-deepspeed", str(src), "--out", str(store_json),
                 "--optimizer-out", str(optim_json)]) == 0
    assert "ignored" in capsys.readouterr().out
    cfg = StoreConfig.from_file(str(store_json))
    assert cfg.cpu_budget == 8 * cfg.bucket_bytes
    kwargs = json.loads(optim_json.read_text())
    assert kwargs.pop("use_muon") == "default"
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    with ZeroMuon(model.named_parameters(), **kwargs, store=cfg) as opt:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        assert opt.store.config.home_of("rank0/muon_momentum") == "cpu"
        homes = {a.name: a.home for a in opt.store._arrays.values()}
    # arrays go by their own names in the rank's folder; the pattern written for the old
    # names ("rank*/muon_momentum") still places the momentum
    assert homes["muon_momentum"] == "cpu"
    assert any(h == "nvme" for n, h in homes.items() if n != "muon_momentum")


def test_bad_inputs_exit_2_naming_the_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["config", "from-deepspeed", str(bad)]) == 2
    assert str(bad) in capsys.readouterr().err
    no_path = tmp_path / "nvme.json"
    no_path.write_text(json.dumps({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}))
    assert main(["config", "from-deepspeed", str(no_path)]) == 2
    err = capsys.readouterr().err
    assert str(no_path) in err and "nvme_paths" in err
    assert main(["config", "from-deepspeed", str(tmp_path / "missing.json")]) == 2


def test_json_output(capsys):
    assert main(["config", "from-deepspeed", FIXTURE, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"store", "optimizer", "report", "warnings", "loop_code"}
    assert len(doc["report"]) == len(leaves(fixture()))
