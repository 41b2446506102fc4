"""offload-engine inspect: kind detection, listing from metadata only, streamed statistics,
optimizer health and the NaN/Inf exit code, on every input kind (live store, our
checkpoint, DeepSpeed fixtures, safetensors file and sharded index)."""

from __future__ import annotations

import glob
import json
import math
import os

import pytest
import torch

from offload_engine.offline.consolidate import consolidate
from offload_engine.formats.deepspeed import DeepSpeedSource
from offload_engine.formats.deepspeed.scatter_read import ScatterReader
from offload_engine.formats import detect, open_source
from offload_engine.offline.inspect_stats import collect_stats
from offload_engine.offline.health import layer_of
from offload_engine.offline.value_stats import StatsTable

from helpers.synthetic import reseal
from helpers.inspect_fixtures import (DS_ALL, FIXTURES, make_checkpoint, make_live_store,
                                   model_tensors, run_cli)


@pytest.fixture
def ckpt(tmp_path):
    return make_checkpoint(tmp_path / "ckpt")


@pytest.fixture
def store(tmp_path):
    return make_live_store(tmp_path / "store")


def reference_stats(t: torch.Tensor) -> dict:
    x = t.reshape(-1).double()
    fin = x[torch.isfinite(x)]
    return {"count": x.numel(), "nan": int(x.isnan().sum()), "inf": int(x.isinf().sum()),
            "min": float(fin.min()), "max": float(fin.max()), "mean": float(fin.mean()),
            "l2": float(fin.norm()), "rms": float(fin.norm()) / math.sqrt(fin.numel()),
            "zero_fraction": float((x == 0).sum()) / x.numel()}


def assert_stats(got: dict, t: torch.Tensor) -> None:
    want = reference_stats(t)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12), (k, got[k], v)


# -- detection -----------------------------------------------------------------------------

def test_detect_every_kind(tmp_path, ckpt, store):
    root, _ = ckpt
    assert detect(root)[0] == "checkpoint"
    assert detect(os.path.join(root, "step-00000007"))[:1] == ("checkpoint",)
    assert detect(store[0])[0] == "store"
    z2 = os.path.join(FIXTURES, "zero2_w3_fp32")
    assert detect(z2) == ("deepspeed", z2, "global_step2")
    assert detect(os.path.join(z2, "global_step2")) == ("deepspeed", z2, "global_step2")
    st = os.path.join(z2, "expected_zero_to_fp32.safetensors")
    assert detect(st)[0] == "safetensors"
    assert detect(z2, generation="global_step2")[0] == "deepspeed"


# -- listing ----------------------------------------------------------------------------------

def test_list_checkpoint_and_store(ckpt, store, capsys):
    for path, kind, step in ((ckpt[0], "checkpoint", 7), (store[0], "live store", 11)):
        rc, out, err = run_cli(["inspect", path, "--json"], capsys)
        assert rc == 0, err
        doc = json.loads(out)
        s = doc["summary"]
        assert s["kind_label"].endswith(kind) and s["step"] == step and s["world_size"] == 4
        # checkpoints: version 4 (training state); stores: version 3 (one folder per rank)
        assert s["format_version"] == (4 if kind == "checkpoint" else 3)
        assert not [n for n in s["notes"] if "not checksummed" in n or "is not:" in n]
        rows = {r["name"]: r for r in doc["tensors"]}
        assert set(rows) == set(model_tensors())
        wq = rows["layers.0.attn.wq.weight"]
        assert wq["shape"] == [48, 40] and wq["dtype"] == "bfloat16" and wq["optimizer"] == "muon"
        assert wq["states"] == ["param", "master", "momentum_buffer"]
        assert rows["scalar"]["shape"] == []
        # 48 rows over 4 ranks: 12 each; master fp32 = 12*40*4 bytes per rank
        assert s["bytes_by_state"]["momentum_buffer"] == 2 * 48 * 40 * 4
        assert set(s["bytes_by_rank"]) == {"0", "1", "2", "3"}
        assert sum(s["bytes_by_rank"].values()) == sum(s["bytes_by_state"].values())
        assert s["dtypes"] == {"bfloat16": 3, "float32": 3}


def test_listing_reads_no_chunk_file(ckpt, capsys):
    """Truncate every chunk file: listing still works (it never opens them); --stats
    names the first truncated chunk."""
    root, _ = ckpt
    chunks = glob.glob(os.path.join(root, "step-*", "rank*", "*", "c", "*"))
    assert len(chunks) > 20
    for c in chunks:
        os.truncate(c, 0)
    rc, out, err = run_cli(["inspect", root], capsys)
    assert rc == 0, err
    assert "layers.0.attn.wq.weight" in out
    rc, out, err = run_cli(["inspect", root, "--stats"], capsys)
    assert rc == 2 and "truncated chunk" in err and "/c/" in err


def test_filters(ckpt, capsys):
    rc, out, err = run_cli(["inspect", ckpt[0], "--name", "layers.*.attn.*", "--state",
                            "momentum_buffer", "--json"], capsys)
    doc = json.loads(out)
    assert [r["name"] for r in doc["tensors"]] == ["layers.0.attn.wq.weight",
                                                    "layers.1.attn.wq.weight"]
    assert all(r["states"] == ["momentum_buffer"] for r in doc["tensors"])
    assert list(doc["summary"]["bytes_by_state"]) == ["momentum_buffer"]


def test_bare_store_lists_flat_arrays(tmp_path, capsys):
    root, _ = make_live_store(tmp_path / "bare", with_table=False)
    rc, out, err = run_cli(["inspect", root], capsys)
    assert rc == 0, err
    assert "NAME" in out and "NUMEL" in out and "HOME" in out
    assert "rank0/momentum_buffer" in out and "nvme" in out
    assert "no tensor table" in out
    rc, out, err = run_cli(["inspect", root, "--stats", "--json", "--name", "rank2/*"], capsys)
    doc = json.loads(out)
    assert {s["name"] for s in doc["stats"]} == {f"rank2/{a}" for a in (
        "exp_avg", "exp_avg_sq", "master", "momentum_buffer", "param", "param_bfloat16")}


@pytest.mark.parametrize("fixture", DS_ALL)
def test_list_deepspeed(fixture, capsys, monkeypatch):
    def no_reads(self, wants):
        raise AssertionError("listing read tensor data")
    monkeypatch.setattr(ScatterReader, "read", no_reads)
    path = os.path.join(FIXTURES, fixture)
    rc, out, err = run_cli(["inspect", path, "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    s = doc["summary"]
    assert s["kind"] == "deepspeed" and s["step"] == 2 and s["generation"] == "global_step2"
    assert s["world_size"] == int(fixture.split("_w")[1][0])
    rows = {r["name"]: r for r in doc["tensors"]}
    assert rows["emb.weight"]["states"] == ["master", "exp_avg", "exp_avg_sq"]
    assert rows["emb.weight"]["optimizer"] == "adamw"
    assert rows["offs"]["kind"] == "buffer" and rows["offs"]["dtype"] == "int64"
    assert set(s["bytes_by_rank"]) == {str(r) for r in range(s["world_size"])} | {"unsharded"}
    assert s["bytes_by_state"]["exp_avg"] == s["bytes_by_state"]["master"]


def test_list_safetensors_file_and_index(tmp_path, capsys):
    z3 = os.path.join(FIXTURES, "zero3_w3_fp32")
    with DeepSpeedSource(z3) as src:
        consolidate(src, str(tmp_path / "hf"), max_shard_bytes=1000)
    index = tmp_path / "hf" / "model.safetensors.index.json"
    assert index.exists()
    for path in (index, tmp_path / "hf"):
        rc, out, err = run_cli(["inspect", path, "--json"], capsys)
        assert rc == 0, err
        doc = json.loads(out)
        assert doc["summary"]["kind"] == "safetensors"
        rows = {r["name"]: r for r in doc["tensors"]}
        assert rows["emb.weight"]["kind"] == "param"
        # an alias, listed as one: it stores nothing of its own
        assert rows["head.weight"]["kind"] == "tied" and rows["head.weight"]["bytes"] == 0
        assert rows["head.weight"]["tied_to"] == "emb.weight"
        assert len(doc["summary"]["files"]) == 1 + len(glob.glob(str(tmp_path / "hf" / "*.safetensors")))
    with open_source(str(index)) as s:
        assert s.aliases() == {"head.weight": "emb.weight"}


# -- statistics ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,workers", [("checkpoint", 1), ("checkpoint", 3), ("store", 2)])
def test_stats_match_torch(tmp_path, kind, workers):
    make = make_checkpoint if kind == "checkpoint" else make_live_store
    root, tensors = make(tmp_path / kind)
    with open_source(root, window_bytes=4096, depth=3) as s:  # many windows, several threads
        keys = [(t.name, st) for t in s.tensors() for st in t.states]
        stats, nbytes = collect_stats(s, keys, workers=workers)
    assert nbytes > 0
    for (name, state), got in stats.items():
        assert_stats(got, tensors[name]["states"][state])


@pytest.mark.parametrize("fixture", ["zero1_w4_bf16", "zero2_w3_bf16_aligned", "zero3_w3_fp32"])
def test_stats_deepspeed_match_reassembled_tensors(fixture):
    path = os.path.join(FIXTURES, fixture)
    with open_source(path) as s:
        keys = [(t.name, st) for t in s.tensors() for st in t.states]
        stats, _ = collect_stats(s, keys)
        for t in s.tensors():
            for st in t.states:
                full = torch.empty(t.numel, dtype=t.states[st].dtype.torch)
                s.read_state(t.name, st, 0, full)
                assert_stats(stats[(t.name, st)], full)
    # master weights are exactly what zero_to_fp32 wrote
    from safetensors.torch import load_file
    expected = load_file(os.path.join(path, "expected_zero_to_fp32.safetensors"))
    for name, want in expected.items():
        key = (name, "master") if (name, "master") in stats else (name, "param")
        if key in stats:
            assert_stats(stats[key], want)


def test_moments_agree_across_zero_stages():
    """Same seed, same model: ZeRO-1 and ZeRO-3 runs must hold the same Adam moments, so
    the per-parameter mapping of both is right (not merely self-consistent)."""
    got = {}
    for fixture in ("zero1_w2_fp32", "zero3_w2_fp32"):
        with open_source(os.path.join(FIXTURES, fixture)) as s:
            for t in s.tensors():
                for st in ("exp_avg", "exp_avg_sq"):
                    if st in t.states:
                        out = torch.empty(t.numel)
                        s.read_state(t.name, st, 0, out)
                        got.setdefault((t.name, st), []).append(out)
    assert len(got) == 14
    for key, (a, b) in got.items():
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-9, msg=str(key))


def test_stats_table_many_pieces_nonfinite_and_gaps():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3_000_000, generator=g)
    x[5] = float("nan")
    x[2_999_990] = float("-inf")
    x[1000:1100] = 0
    pieces = [(i, i * 300 + 7, i * 300 + 250) for i in range(10_000)]  # gaps between pieces
    t = StatsTable(len(pieces), block=1 << 18)
    t.visit(x.to(torch.bfloat16), pieces)
    for k in (0, 3, 872, 9_999):
        _, lo, hi = pieces[k]
        got = t.result(k)
        assert_stats(got, x.to(torch.bfloat16)[lo:hi])
    whole = StatsTable(1, block=1 << 18)
    whole.visit(x, [(0, 0, x.numel())])
    r = whole.result(0)
    assert r["nan"] == 1 and r["inf"] == 1
    assert_stats(r, x)


def test_stats_cli_reports_health(ckpt, capsys):
    rc, out, err = run_cli(["inspect", ckpt[0], "--stats"], capsys)
    assert rc == 0, err
    assert "optimizer health" in out and "momentum RMS per layer" in out
    assert "layers.0" in out and "Adam exp_avg_sq: min" in out and "NaN/Inf: none" in out
    rc, out, err = run_cli(["inspect", ckpt[0], "--stats", "--json"], capsys)
    doc = json.loads(out)
    h = doc["health"]
    layers = {(e["layer"], e["state"]) for e in h["momentum_rms_per_layer"]}
    assert ("layers.1", "momentum_buffer") in layers and ("emb", "exp_avg") in layers
    tensors = model_tensors()
    want = min(float(tensors[n]["states"]["exp_avg_sq"].min()) for n in tensors
               if "exp_avg_sq" in tensors[n]["states"])
    assert h["adam_exp_avg_sq"]["min"]["value"] == pytest.approx(want)
    assert doc["bytes_read"] > 0


def test_nan_and_inf_give_exit_code_3(tmp_path, capsys):
    tensors = model_tensors()
    mom = tensors["layers.1.attn.wq.weight"]["states"]["momentum_buffer"]
    mom[30, 7] = float("nan")
    tensors["layers.0.norm.weight"]["states"]["exp_avg_sq"][3] = float("inf")
    root, _ = make_checkpoint(tmp_path / "bad", tensors)
    rc, out, err = run_cli(["inspect", root], capsys)
    assert rc == 0  # listing never reads values
    rc, out, err = run_cli(["inspect", root, "--stats"], capsys)
    assert rc == 3, err
    assert "NaN/Inf in 2 layer(s): layers.0, layers.1" in out
    assert "layers.1.attn.wq.weight/momentum_buffer: 1 NaN, 0 Inf" in out
    rc, out, err = run_cli(["inspect", root, "--stats", "--json"], capsys)
    assert rc == 3
    doc = json.loads(out)
    assert doc["health"]["nonfinite_layers"] == ["layers.0", "layers.1"]


def test_stats_on_deepspeed_and_safetensors_cli(capsys):
    for path in (os.path.join(FIXTURES, "zero2_w4_bf16"),
                 os.path.join(FIXTURES, "zero2_w4_bf16", "expected_zero_to_fp32.safetensors")):
        rc, out, err = run_cli(["inspect", path, "--stats"], capsys)
        assert rc == 0, err
        assert "emb.weight" in out and "NaN/Inf: none" in out


def test_layer_names():
    assert layer_of("model.layers.3.mlp.w1.weight") == "model.layers.3"
    assert layer_of("layers.0.attn.wq.weight") == "layers.0"
    assert layer_of("emb.weight") == "emb"
    assert layer_of("scalar") == "scalar"


def test_scan_memory_is_bounded_by_windows(tmp_path):
    """An 8 MiB state streamed with 256 KiB windows, depth 2 and 2 reducing threads:
    buffers never exceed depth + 2 + workers = 6 windows (the pool is allocated at that
    size and never grows)."""
    big = torch.randn(2 << 20)
    tensors = {"w": {"shape": [2 << 10, 1024], "dtype": torch.float32, "optimizer": "muon",
                     "states": {"momentum_buffer": big}}}
    root, _ = make_checkpoint(tmp_path / "big", tensors, world_size=2)
    from offload_engine.io import BufferPool
    sizes = []
    real_init = BufferPool.__init__

    def spy(self, budget, **kw):
        sizes.append(budget)
        real_init(self, budget, **kw)
    import unittest.mock as mock
    with mock.patch.object(BufferPool, "__init__", spy):
        with open_source(root, window_bytes=256 << 10, depth=2) as s:
            stats, nbytes = collect_stats(s, [("w", "momentum_buffer")], workers=2)
    assert nbytes == big.numel() * 4
    assert max(sizes) <= 6 * (256 << 10)
    assert_stats(stats[("w", "momentum_buffer")], big)


@pytest.mark.skipif(__import__("importlib").util.find_spec("matplotlib") is None,
                    reason="matplotlib (the [plot] extra) is not installed")
@pytest.mark.multiprocess  # matplotlib's first use builds its font cache, running fc-list
def test_plot_writes_png(ckpt, tmp_path, capsys):
    out_png = tmp_path / "norms.png"
    rc, out, err = run_cli(["inspect", ckpt[0], "--plot", out_png], capsys)
    assert rc == 0, err
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_clear_error(ckpt, tmp_path, capsys, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("no matplotlib")
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    rc, out, err = run_cli(["inspect", ckpt[0], "--plot", tmp_path / "x.png"], capsys)
    assert rc == 2 and "matplotlib" in err and len(err.strip().splitlines()) == 1


def test_torch_state_names(tmp_path, capsys):
    """checkpoint.save names the fp32 copy ``master_param``, as torch does: it is the
    tensor's weight state, like ``master``."""
    from offload_engine.layout import read_group, write_group_attributes
    from offload_engine.layout.manifest import read_shard_table, write_shard_table
    root, tensors = make_checkpoint(tmp_path / "ck")
    gen = os.path.join(root, "step-00000007")
    attrs = read_group(gen)
    for entry in attrs["tensors"].values():
        if "master" in entry["states"]:
            entry["states"]["master_param"] = entry["states"].pop("master")
    write_group_attributes(gen, attrs)
    for r in range(4):
        table = read_shard_table(gen, r)
        for shard in table.values():
            if "master" in shard["states"]:
                shard["states"]["master_param"] = shard["states"].pop("master")
        write_shard_table(gen, r, table)
    reseal(gen)  # the edit stands for a writer that names them so
    rc, out, err = run_cli(["inspect", root, "--stats", "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    rows = {r["name"]: r for r in doc["tensors"]}
    assert sorted(rows["emb.weight"]["states"]) == ["exp_avg", "exp_avg_sq", "master_param", "param"]
    rc, out, err = run_cli(["export", root, "emb.weight", "--out", tmp_path / "e.pt"], capsys)
    assert rc == 0 and "(master_param," in out
    assert torch.equal(torch.load(tmp_path / "e.pt", weights_only=True),
                       tensors["emb.weight"]["states"]["master"])


def test_real_checkpoint_from_zero_muon(tmp_path, capsys):
    """A checkpoint written by the checkpoint layer's own save_checkpoint (ZeroMuon, one
    process): listed, its statistics streamed, its parameters exported as saved."""
    try:
        from offload_engine.checkpoint import save_checkpoint
        from offload_engine.optim import ZeroMuon
    except ImportError:
        pytest.skip("the checkpoint writer is not available")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.Linear(6, 24),
                                torch.nn.Linear(24, 8, bias=False))
    opt = ZeroMuon(model.named_parameters(), lr=0.02, adamw={"lr": 1e-3},
                   store={"nvme_paths": [str(tmp_path / "state")], "bucket_bytes": 4096,
                          "cpu_budget": 65536, "prefetch_depth": 1, "io_threads": 2})
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    save_checkpoint(str(tmp_path / "ck"), model, opt, 2)
    opt.close()
    rc, out, err = run_cli(["inspect", tmp_path / "ck", "--stats", "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["summary"]["kind"] == "checkpoint" and doc["summary"]["step"] == 2
    rows = {r["name"]: r for r in doc["tensors"]}
    assert set(rows) == {n for n, _ in model.named_parameters()}
    assert any("momentum_buffer" in r["states"] for r in rows.values())
    for name, p in model.named_parameters():
        out_file = tmp_path / f"{name}.pt"
        rc, o, err = run_cli(["export", tmp_path / "ck", name, "--state", "param", "--out",
                              out_file], capsys)
        assert rc == 0, err
        assert torch.equal(torch.load(out_file, weights_only=True), p.detach())
    rc, o, err = run_cli(["diff", tmp_path / "ck", tmp_path / "ck", "--state", "all"], capsys)
    assert rc == 0, o + err


def test_layer_norms_for_the_plot():
    from offload_engine.offline.plot import layer_norms
    s = lambda sq: {"sumsq": sq}
    stats = {("layers.0.w", "master"): s(9.0), ("layers.0.b", "master"): s(16.0),
             ("layers.1.w", "master"): s(4.0), ("layers.1.w", "exp_avg"): s(1.0),
             ("emb.weight", "exp_avg"): s(0.25)}
    layers, norms = layer_norms(stats, ["emb.weight", "layers.0.w", "layers.0.b", "layers.1.w",
                                        "not.in.stats"])
    assert layers == ["emb", "layers.0", "layers.1"]
    assert norms["master"][1:] == [5.0, 2.0] and math.isnan(norms["master"][0])
    assert norms["exp_avg"][0] == 0.5 and math.isnan(norms["exp_avg"][1])
