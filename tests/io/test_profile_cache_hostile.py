"""A bad device-profile cache is ignored with a warning, never a crash (docs/store.md; issue 30,
item 10): nested 100,000 deep, over the size cap, binary, a FIFO, /dev/zero, wrong types or
out-of-range settings. The store, offline readers and ``choose`` fall back to a probe or the
built-in defaults, and a probe replaces the bad entry."""

import json
import logging
import os

import pytest

from offload_engine.io import device_profile as dp
from offload_engine.io.settings import DEFAULT
from offload_engine.store import TieredStore

from helpers.alarm_deadline import alarm_within

KiB = 1024


def _good(directory: str) -> dict:
    return {"format": dp.FORMAT, "format_version": dp.FORMAT_VERSION,
            "key": dp.profile_key(directory),
            "read": {"mode": "buffered", "queue_depth": 4, "block_bytes": 128 * KiB, "streams": 2},
            "write": {"mode": "direct", "queue_depth": 2, "block_bytes": 256 * KiB},
            "points": [{"mode": "direct", "queue_depth": 2, "block_bytes": 256 * KiB,
                        "streams": 1, "read_gbps": 1.0, "write_gbps": 0.5}]}


def _with(doc: dict, path: str, value) -> dict:
    doc = json.loads(json.dumps(doc))
    node = doc
    *parents, last = path.split(".")
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    node[last if not isinstance(node, list) else int(last)] = value
    return doc


BAD_DOCUMENTS = {
    "nested 100,000 deep": b'{"format": "offload-engine-io-profile", "x": ' + b"[" * 100_000
                           + b"]" * 100_000 + b"}",
    "binary": bytes(range(256)) * 8,
    "over the size cap": b" " * ((1 << 20) + 1) + b"{}",  # MAX_CACHE_BYTES is 1 MiB
    "NaN": None,  # filled in per directory below
}
BAD_VALUES = [
    ("read.queue_depth", "4"), ("read.queue_depth", 0), ("read.queue_depth", -3),
    ("read.queue_depth", 10**9), ("read.queue_depth", True), ("read.queue_depth", 4.5),
    ("read.block_bytes", 1000), ("read.block_bytes", 1 << 40), ("read.streams", 0),
    ("read.mode", "fast"), ("read", [1, 2]), ("write", None), ("points", {"a": 1}),
    ("points", [1, 2]), ("points.0.mode", None), ("points.0.read_gbps", "fast"),
    ("points.0.queue_depth", [8]), ("measured_at", {"a": 1}),
]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(dp.PROFILE_DIR_ENV, str(tmp_path / "profiles"))
    monkeypatch.setenv(dp.PROBE_ENV, "0")
    dp.forget_memo()
    data = tmp_path / "data"
    data.mkdir()
    os.makedirs(tmp_path / "profiles")
    yield str(data), dp.profile_file(str(data))
    dp.forget_memo()


def _cases(directory: str):
    out = [(name, raw) for name, raw in BAD_DOCUMENTS.items() if raw is not None]
    out.append(("NaN", json.dumps(_good(directory)).replace('"queue_depth": 4', '"queue_depth": NaN')
                .encode()))
    for key, value in BAD_VALUES:
        out.append((f"{key} = {value!r}", json.dumps(_with(_good(directory), key, value)).encode()))
    return out


def _assert_ignored(directory, file, caplog):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=dp.__name__):
        assert dp.load(directory) is None
        got = dp.choose(directory)
        assert got["source"] == "default"
        assert dp.settings_of(got, "read").shape() == DEFAULT.shape()
        assert dp.reader_settings(directory, 4).source == "default"
    assert any(file in r.getMessage() for r in caplog.records), caplog.text


def test_a_good_cache_is_used(cache):
    directory, file = cache
    with open(file, "w") as f:
        json.dump(_good(directory), f)
    assert dp.load(directory)["read"]["queue_depth"] == 4
    assert dp.reader_settings(directory, 1).queue_depth == 4


def test_every_bad_cache_is_ignored_with_a_warning(cache, caplog):
    directory, file = cache
    for name, raw in _cases(directory):
        with open(file, "wb") as f:
            f.write(raw)
        try:
            _assert_ignored(directory, file, caplog)
        except Exception as e:
            raise AssertionError(f"cache {name}: {type(e).__name__}: {e}") from None
        dp.forget_memo()


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_special_file_as_the_cache_is_ignored_without_blocking(cache, caplog, kind):
    directory, file = cache
    if kind == "fifo":
        os.mkfifo(file)
    else:
        os.symlink("/dev/zero", file)
    with alarm_within(20):
        _assert_ignored(directory, file, caplog)


def test_the_store_opens_over_a_deep_cache_and_a_probe_replaces_it(cache, monkeypatch):
    directory, file = cache
    with open(file, "wb") as f:
        f.write(BAD_DOCUMENTS["nested 100,000 deep"])
    with TieredStore(dict(nvme_paths=[directory], cpu_budget=1 << 20,
                          bucket_bytes=256 * KiB)) as s:
        assert s.io_settings()["profile"]["source"] == "default"
    monkeypatch.setattr(dp, "PROBE_BYTES", 1 << 20)
    monkeypatch.setattr(dp, "REQUEST_BYTES", 256 * KiB)
    monkeypatch.setattr(dp, "CASES", (("buffered", 2, 64 * KiB, 1),))
    assert dp.choose(directory, probe_allowed=True)["source"] == "probe"
    dp.forget_memo()
    assert dp.load(directory) is not None  # the probe wrote a good entry over the bad one
