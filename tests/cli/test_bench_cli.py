"""`offload-engine bench io` and tools/bench_io.py at tiny sizes (the demo: test_demo.py).

Never asserts on times or speeds beyond "positive": the disk here is shared and noisy.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from offload_engine.io import page_cache

from offload_engine.cli import bench_io
from offload_engine.cli.main import main
from helpers.paths import ROOT

HAVE_FIO = shutil.which("fio") is not None
TOP_KEYS = {"size_bytes", "block_size", "queue_depth", "chunk_bytes", "runs", "direct",
            "baseline", "fio_args", "methods", "ratios", "engine", "environment", "notes"}
METHOD_KEYS = {"write_gbps", "read_gbps", "write_runs", "read_runs", "write_cpu_s",
               "read_cpu_s"}


def _bench(capsys, *args) -> tuple[int, str, str]:
    rc = main(["bench", "io", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


def _check_result(doc: dict, *, size: int, runs: int, baseline: str) -> None:
    assert TOP_KEYS <= set(doc)
    assert doc["size_bytes"] == size and doc["runs"] == runs
    assert doc["baseline"] == baseline
    assert isinstance(doc["direct"], bool)
    peers = {baseline, "zarr_python", "tensorstore"} | ({"fio_buffered"} if baseline == "fio" else set())
    assert set(doc["methods"]) == {"engine"} | peers
    for name, m in doc["methods"].items():
        assert METHOD_KEYS <= set(m), name
        assert m["write_gbps"] > 0 and m["read_gbps"] > 0, name
        assert len(m["write_runs"]) == runs and len(m["read_runs"]) == runs, name
        assert all(x > 0 for x in m["write_runs"] + m["read_runs"]), name
        assert m["write_cpu_s"] >= 0 and m["read_cpu_s"] >= 0, name
    for key in (f"engine_vs_{baseline}_write", f"engine_vs_{baseline}_read",
                "engine_vs_zarr_python_read", "engine_vs_tensorstore_read"):
        assert doc["ratios"][key] > 0, key
    if baseline == "fio":
        assert {"--rw=write", "--end_fsync=1", "--direct=1"} <= set(doc["fio_args"]["write"]) \
            or not doc["direct"]
        assert "--rw=read" in doc["fio_args"]["read"]
        assert f"--iodepth={doc['queue_depth']}" in doc["fio_args"]["read"]
        assert f"--bs={doc['block_size']}" in doc["fio_args"]["read"]
    else:
        assert doc["fio_args"] is None
    if doc["direct"]:
        assert doc["engine"]["direct_pieces"] > 0 and doc["engine"]["buffered_pieces"] == 0
    for column in ("read", "write"):  # the best peer per direction, and the engine's ratio
        best = doc["best_peer"][column]
        assert best["method"] in peers
        assert best["gbps"] == max(doc["methods"][p][f"{column}_gbps"] for p in peers)
        assert best["engine_vs_best"] == pytest.approx(best["engine_gbps"] / best["gbps"], rel=0.01)
        io = doc["io"][column]  # the engine's settings, and where they came from
        assert io["mode"] in ("direct", "buffered") and io["source"] in ("config", "profile",
                                                                          "default")


@pytest.mark.multiprocess
def test_json_has_every_key_and_positive_numbers(disk_dir, capsys):
    rc, out, err = _bench(capsys, "--path", disk_dir, "--size", "8MiB", "--runs", 1, "--json")
    assert rc == 0, err
    doc = json.loads(out)  # one JSON object, nothing else on stdout
    _check_result(doc, size=8 << 20, runs=1, baseline="fio" if HAVE_FIO else "odirect_loop")
    assert os.listdir(disk_dir) == []  # the benchmark folder is removed


def test_odirect_loop_baseline_several_chunks_and_runs(disk_dir, capsys):
    rc, out, err = _bench(capsys, "--path", disk_dir, "--size", "4MiB", "--chunk-size", "512KiB",
                          "--block-size", "256KiB", "--queue-depth", 3, "--runs", 2, "--json",
                          "--baseline", "odirect_loop")
    assert rc == 0, err
    doc = json.loads(out)
    _check_result(doc, size=4 << 20, runs=2, baseline="odirect_loop")
    assert doc["chunk_bytes"] == 512 << 10 and doc["block_size"] == 256 << 10
    assert doc["engine"]["threads"] == 3 and doc["engine"]["ring_buffers"] >= 2


def test_without_fio_auto_falls_back_and_explicit_fio_fails_cleanly(disk_dir, capsys, monkeypatch):
    monkeypatch.setattr(bench_io.shutil, "which", lambda name: None)
    rc, out, err = _bench(capsys, "--path", disk_dir, "--size", "1MiB", "--runs", 1, "--json")
    assert rc == 0, err
    assert json.loads(out)["baseline"] == "odirect_loop"
    rc, out, err = _bench(capsys, "--path", disk_dir, "--size", "1MiB", "--baseline", "fio")
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "fio is not installed" in err


@pytest.mark.multiprocess
@pytest.mark.skipif(not HAVE_FIO, reason="fio is not installed")
def test_fio_baseline_when_installed(disk_dir, capsys):
    rc, out, err = _bench(capsys, "--path", disk_dir, "--size", "2MiB", "--block-size", "1MiB",
                          "--queue-depth", 2, "--runs", 1, "--json", "--baseline", "fio")
    assert rc == 0, err
    _check_result(json.loads(out), size=2 << 20, runs=1, baseline="fio")


@pytest.mark.multiprocess
def test_table_mentions_every_method_and_ratio(disk_dir, capsys):
    rc, out, err = _bench(capsys, "--path", disk_dir, "--size", "4MiB", "--runs", 1)
    assert rc == 0, err
    baseline = "fio" if HAVE_FIO else "odirect_loop"
    for word in ("engine", baseline, "zarr_python", "tensorstore", "write GB/s", "read GB/s",
                 "queue depth"):
        assert word in out, word
    assert not out.lstrip().startswith("{")


@pytest.mark.parametrize("where", ["missing", "under_a_file", "a_file"])
def test_unusable_path_exits_2_with_one_line(disk_dir, capsys, where):
    (disk_dir / "file").write_text("x")
    path = {"missing": disk_dir / "missing",
            "under_a_file": disk_dir / "file" / "sub",  # ENOTDIR, even for root
            "a_file": disk_dir / "file"}[where]
    rc, out, err = _bench(capsys, "--path", path, "--size", "1MiB", "--runs", 1)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0], err
    assert sorted(os.listdir(disk_dir)) == ["file"]


def test_not_enough_space_exits_2_before_writing(disk_dir, capsys, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(bench_io.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=10 << 20))
    rc, out, err = _bench(capsys, "--path", disk_dir, "--size", "8MiB", "--runs", 1)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "free" in err
    files = 5 if HAVE_FIO else 4  # engine, (fio O_DIRECT, fio buffered | odirect_loop), 2 peers
    assert f"{files} x --size" in err and f"{files * 8 + 64}.00 MiB" in err, err
    assert os.listdir(disk_dir) == []


@pytest.mark.parametrize("args", [["--size", "5000"], ["--size", "12MiB", "--block-size", "8MiB"],
                                  ["--block-size", "1000"], ["--chunk-size", "6000"]])
def test_bad_sizes_exit_2_with_one_line(disk_dir, capsys, args):
    rc, out, err = _bench(capsys, "--path", disk_dir, *args, "--runs", 1)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "multiple" in err


@pytest.mark.multiprocess
def test_keep_leaves_the_engine_array_readable_by_zarr(disk_dir, capsys):
    zarr = pytest.importorskip("zarr")
    rc, out, err = _bench(capsys, "--path", disk_dir, "--size", "1MiB", "--runs", 1, "--json",
                          "--keep")
    assert rc == 0, err
    (kept,) = os.listdir(disk_dir)
    arr = zarr.open_array(str(disk_dir / kept / "engine.zarr"), mode="r")
    assert arr.shape == ((1 << 20) // 4,) and str(arr.dtype) == "float32"


@pytest.mark.multiprocess
def test_tools_script_prints_json(disk_dir):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_io.py"),
                           "--path", str(disk_dir), "--size", "1MiB", "--runs", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["size_bytes"] == 1 << 20 and "ratios" in doc


def test_eviction_leaves_nothing_cached(disk_dir):
    path = disk_dir / "f"
    path.write_bytes(os.urandom(1 << 20))  # through the page cache
    if page_cache.resident_bytes([str(path)]) == 0:
        pytest.skip("this file system does not keep written pages cached")
    assert page_cache.evict_and_check([str(disk_dir)]) == 0


@pytest.mark.parametrize("methods", [2, 3, 4, 5])
def test_run_order_puts_each_method_first_once_and_varies_who_comes_before(methods):
    runs = methods * 2
    orders = [bench_io.run_order(methods, r) for r in range(runs)]
    for order in orders:
        assert sorted(order) == list(range(methods))
    for start in range(0, runs, methods):  # every window of `methods` runs: each first once
        assert sorted(o[0] for o in orders[start:start + methods]) == list(range(methods))
    if methods > 2:  # with two methods there is only one possible predecessor
        for m in range(methods):
            before = {o[o.index(m) - 1] for o in orders if o[0] != m}
            assert len(before) > 1, f"method {m} always follows {before}"
