"""`offload-engine bench disk` at tiny sizes: the sweep, the per-device cache, and plan using it.

Never asserts on speeds beyond "positive": the disk here is shared and noisy.
"""

import json
import os

import pytest

from offload_engine.cli.main import main
from offload_engine.plan import disk_profile

from helpers.paths import FIXTURES

GPT2 = os.path.join(FIXTURES, "hf_configs", "gpt2.json")
TINY = ["--size", "1MiB", "--block-sizes", "256KiB,512KiB", "--queue-depths", "1,2",
        "--request-size", "512KiB"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv(disk_profile.CACHE_ENV, str(d))
    return d


def test_sweep_caches_the_best_point_and_plan_uses_it(tmp_path, cache, capsys):
    disk = tmp_path / "disk"
    disk.mkdir()
    rc = main(["bench", "disk", "--path", str(disk), "--quick", *TINY, "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    doc = json.loads(out)
    assert len(doc["points"]) == 4 and doc["quick"] and doc["size_bytes"] == 1 << 20
    for p in doc["points"]:
        assert p["read_gbps"] > 0 and p["write_gbps"] > 0 and p["io_threads"] == p["queue_depth"]
    best = doc["best"]
    assert best == min(({k: p[k] for k in best} for p in doc["points"]),
                       key=lambda p: (1 / p["write_gbps"] + 1 / p["read_gbps"], p["queue_depth"],
                                      p["block_size"]))
    assert os.listdir(disk) == []  # the temporary folder is gone
    # cached per device, found again from any directory on that device
    cached = disk_profile.load_profile(str(disk))
    assert cached is not None and cached["best"] == best
    assert os.path.dirname(cached["file"]) == str(cache)
    assert os.path.basename(cached["file"]) == f"disk-{disk_profile.device_id(str(disk))}.json"
    assert disk_profile.load_profile(str(tmp_path))["best"] == best

    rc = main(["plan", "--model", GPT2, "--world-size", "1", "--device", "cpu", "--cpu-mem",
               "4600MiB", "--nvme", str(disk), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    plan = json.loads(out)
    bw = plan["traffic"]["bandwidth"]
    assert bw["read_gbps"] == best["read_gbps"] and bw["write_gbps"] == best["write_gbps"]
    assert bw["source"].startswith("bench disk") and cached["file"] in bw["source"]
    cfg = plan["store_config"]
    assert (cfg["io_threads"], cfg["queue_depth"], cfg["block_size"]) == (
        best["io_threads"], best["queue_depth"], best["block_size"])
    assert plan["traffic"]["io_time_s_mean"] > 0


def test_text_table_and_threads_list(tmp_path, cache, capsys):
    rc = main(["bench", "disk", "--path", str(tmp_path), *TINY[:2], "--block-sizes", "512KiB",
               "--queue-depths", "2", "--threads", "1,2", "--request-size", "512KiB", "--repeats",
               "2", "--no-cache"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "<- best" in out and "best: block_size" in out
    assert out.count("512.00 KiB") >= 2
    assert not cache.exists()  # --no-cache


def test_unreadable_or_foreign_cache_is_ignored(tmp_path, cache):
    cache.mkdir()
    file = disk_profile.profile_path(str(tmp_path))
    with open(file, "w") as f:
        f.write("{not json")
    assert disk_profile.load_profile(str(tmp_path)) is None
    with open(file, "w") as f:
        json.dump({"format": "something-else", "best": {}}, f)
    assert disk_profile.load_profile(str(tmp_path)) is None


def test_bad_arguments_exit_2(tmp_path, cache, capsys):
    rc = main(["bench", "disk", "--path", str(tmp_path / "missing"), "--quick"])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and "not an existing directory" in err
    for args in (["--block-sizes", "1000"], ["--queue-depths", "0"], ["--size", "12KB"]):
        with pytest.raises(SystemExit) as e:
            main(["bench", "disk", "--path", str(tmp_path), *args])
        assert e.value.code == 2
        assert "error:" in capsys.readouterr().err


def test_bench_io_is_still_there(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "io", "--help"])
    assert e.value.code == 0
    assert "--queue-depth" in capsys.readouterr().out


def test_best_point_as_a_deepspeed_aio_block_round_trips(tmp_path, cache, capsys):
    """`bench disk --deepspeed-aio` prints an aio block; `config from-deepspeed` maps it back
    to the point that was measured best."""
    from offload_engine.plan.deepspeed_config import translate

    disk = tmp_path / "disk"
    disk.mkdir()
    assert main(["bench", "disk", "--path", str(disk), "--quick", *TINY, "--threads", "1,2",
                 "--deepspeed-aio"]) == 0
    block = json.loads(capsys.readouterr().out)
    assert set(block) == {"aio"}
    best = disk_profile.load_profile(str(disk))["best"]
    assert block["aio"]["block_size"] == best["block_size"]
    store = translate(block).store
    assert store["block_size"] == best["block_size"]
    assert store["queue_depth"] == min(best["queue_depth"], best["io_threads"])


@pytest.mark.parametrize("mode", [[], ["--json"], ["--deepspeed-aio"]])
def test_says_where_it_saved_and_how_not_to(mode, tmp_path, cache, capsys):
    """It writes into the user's cache folder: it says so, where, and the opt-out (issue 31)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    assert main(["bench", "disk", "--path", str(disk), "--quick", *TINY[:2], "--block-sizes",
                 "256KiB", "--queue-depths", "1", *TINY[-2:], *mode]) == 0
    out, err = capsys.readouterr()
    saved = [str(p) for p in cache.rglob("*") if p.is_file()]
    assert len(saved) == 1
    said = out if not mode else err  # stdout holds JSON with --json and --deepspeed-aio
    assert f"saved to {saved[0]}" in said and "--no-cache" in said
    if mode:
        json.loads(out)
