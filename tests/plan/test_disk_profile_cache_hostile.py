"""A bad ``bench disk`` cache entry is ignored with a warning by ``plan --nvme``, never a crash
or a hang (docs/untrusted-input.md): nested 100,000 deep, NaN, wrong types, a FIFO."""

import json
import logging
import os

import pytest

from offload_engine.cli.main import main
from offload_engine.plan import disk_profile

from helpers.alarm_deadline import alarm_within
from helpers.paths import FIXTURES

GPT2 = os.path.join(FIXTURES, "hf_configs", "gpt2.json")
BEST = {"read_gbps": 2.0, "write_gbps": 1.0, "block_size": 1 << 20, "queue_depth": 8,
        "io_threads": 8}


def _doc(**best) -> str:
    return json.dumps({"format": disk_profile.FORMAT, "format_version": disk_profile.FORMAT_VERSION,
                       "best": {**BEST, **best}})


BAD = [
    ("deep", '{"best": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    ("NaN", _doc().replace('"read_gbps": 2.0', '"read_gbps": NaN')),
    ("Infinity", _doc().replace('"read_gbps": 2.0', '"read_gbps": 1e400')),
    ("string", _doc(queue_depth="8")), ("float depth", _doc(queue_depth=8.5)),
    ("bool", _doc(io_threads=True)), ("huge", _doc(block_size=10**30)),
    ("binary", "\udcff" * 10),
]


@pytest.fixture
def disk(tmp_path, monkeypatch):
    monkeypatch.setenv(disk_profile.CACHE_ENV, str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    d = tmp_path / "disk"
    d.mkdir()
    return str(d)


def _plan(capsys, disk):
    with alarm_within(20):
        rc = main(["plan", "--model", GPT2, "--world-size", "1", "--nvme", disk, "--json"])
    out, err = capsys.readouterr()
    assert rc == 0 and "Traceback" not in err, err
    return json.loads(out)


def test_a_good_entry_is_used(disk, capsys):
    with open(disk_profile.profile_path(disk), "w") as f:
        f.write(_doc())
    assert disk_profile.load_profile(disk)["best"] == BEST


@pytest.mark.parametrize("name, text", BAD, ids=[b[0] for b in BAD])
def test_a_bad_entry_is_ignored_with_a_warning(disk, capsys, caplog, name, text):
    with open(disk_profile.profile_path(disk), "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(text)
    with caplog.at_level(logging.WARNING, logger=disk_profile.__name__):
        assert disk_profile.load_profile(disk) is None
    assert disk_profile.profile_path(disk) in caplog.text
    _plan(capsys, disk)


def test_a_fifo_entry_is_ignored_without_blocking(disk, capsys):
    os.mkfifo(disk_profile.profile_path(disk))
    with alarm_within(20):
        assert disk_profile.load_profile(disk) is None
    _plan(capsys, disk)
