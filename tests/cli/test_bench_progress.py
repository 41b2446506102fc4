"""Progress bars with rate and ETA on `bench disk` (the sweep that writes the disk profile
`plan --nvme` reads) and `bench io`: on stderr when it is a terminal, never with --json,
never on stdout. Tiny sizes: nothing here asserts on speeds."""

from __future__ import annotations

import json

import pytest

from offload_engine.cli.main import main
from offload_engine.plan import disk_profile

from helpers.terminal import assert_bar, terminal

DISK = ["--size", "1MiB", "--block-sizes", "256KiB,512KiB", "--queue-depths", "1,2",
        "--request-size", "512KiB", "--repeats", "1"]
IO = ["--size", "1MiB", "--runs", "1", "--baseline", "odirect_loop"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(disk_profile.CACHE_ENV, str(tmp_path / "cache"))


def test_bench_disk_draws_a_bar_on_a_terminal_with_its_lines_above(tmp_path, cache,
                                                                   monkeypatch, capsys):
    stderr = terminal(monkeypatch)
    assert main(["bench", "disk", "--path", str(tmp_path), *DISK]) == 0
    text = stderr.getvalue()
    assert_bar(text, "bench disk")
    assert "100%" in text and "8.39M/8.39M" in text  # 4 points x (write + read) x 1 MiB
    assert text.count("block 256.00 KiB, depth 1, threads 1: write") == 1, text
    out = capsys.readouterr().out
    assert "best:" in out and "bench disk" not in out.replace("bench disk:", "")


def test_bench_disk_json_draws_no_bar(tmp_path, cache, monkeypatch, capsys):
    stderr = terminal(monkeypatch)
    assert main(["bench", "disk", "--path", str(tmp_path), *DISK, "--json", "--no-cache"]) == 0
    assert stderr.getvalue() == ""
    assert json.loads(capsys.readouterr().out)["best"]


def test_bench_disk_off_a_terminal_prints_its_lines_only(tmp_path, cache, capsys):
    assert main(["bench", "disk", "--path", str(tmp_path), *DISK, "--no-cache"]) == 0
    err = capsys.readouterr().err
    assert "depth 2, threads 2: write" in err and "%" not in err and "\r" not in err


@pytest.mark.multiprocess  # as the other bench io tests: its peers may start processes
def test_bench_io_draws_a_bar_on_a_terminal_and_none_with_json(tmp_path, monkeypatch, capsys):
    stderr = terminal(monkeypatch)
    assert main(["bench", "io", "--path", str(tmp_path), *IO]) == 0
    assert_bar(stderr.getvalue(), "bench io")
    assert "100%" in stderr.getvalue()
    assert "engine" in capsys.readouterr().out
    stderr.truncate(0)
    stderr.seek(0)
    assert main(["bench", "io", "--path", str(tmp_path), *IO, "--json"]) == 0
    assert stderr.getvalue() == ""
    assert json.loads(capsys.readouterr().out)["methods"]["engine"]["read_gbps"] > 0


@pytest.fixture
def small_probe(monkeypatch, tmp_path):
    """Probes of 1 MiB per case, two cases, in a profile directory of this test's own."""
    from offload_engine.io import device_profile as dp

    monkeypatch.setattr(dp, "PROBE_BYTES", 1 << 20)
    monkeypatch.setattr(dp, "REQUEST_BYTES", 256 << 10)
    monkeypatch.setattr(dp, "CASES", (("direct", 2, 256 << 10, 1), ("buffered", 2, 256 << 10, 1)))
    monkeypatch.setenv(dp.PROFILE_DIR_ENV, str(tmp_path / "profiles"))
    dp.forget_memo()
    yield
    dp.forget_memo()


def test_refresh_profile_draws_a_bar_that_ends_complete(tmp_path, small_probe, monkeypatch,
                                                       capsys):
    """The probe's total shrinks when its second pass measures only the contenders: the bar
    still ends at 100%, done equal to total."""
    stderr = terminal(monkeypatch)
    assert main(["bench", "disk", "--path", str(tmp_path), "--refresh-profile"]) == 0
    text = stderr.getvalue()
    assert_bar(text, "probe")
    last = text.rstrip("\n").rsplit("\r", 1)[-1]
    assert "100%" in last, last
    done, total = last.split("| ")[1].split(" ")[0].split("/")
    assert done == total, last
    assert "saved to" in capsys.readouterr().out
    stderr.truncate(0)
    stderr.seek(0)
    assert main(["bench", "disk", "--path", str(tmp_path), "--refresh-profile", "--json"]) == 0
    assert stderr.getvalue() == "" and json.loads(capsys.readouterr().out)["source"] == "probe"
