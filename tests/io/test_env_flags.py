"""On/off environment variables (OFFLOAD_ENGINE_IO_PROBE, OFFLOAD_ENGINE_HUGE_PAGES) take the
usual spellings and refuse the rest by name (issue 30, item 10: only exactly "0" turned the
probe off, so "false" probed)."""

import pytest

from offload_engine.envflags import parse_flag
from offload_engine.errors import InputError
from offload_engine.io import align
from offload_engine.io import device_profile as dp


@pytest.mark.parametrize("raw", ["0", "false", "FALSE", "No", " off ", "off\n"])
def test_off_spellings(raw):
    assert parse_flag("X", raw, True) is False


@pytest.mark.parametrize("raw", ["1", "true", "True", "YES", " on "])
def test_on_spellings(raw):
    assert parse_flag("X", raw, False) is True


@pytest.mark.parametrize("raw", [None, "", "  "])
def test_unset_or_blank_is_the_default(raw):
    assert parse_flag("X", raw, True) is True and parse_flag("X", raw, False) is False


@pytest.mark.parametrize("raw", ["fasle", "2", "disabled", "0 1", "-1", "\x1b[2J"])
def test_anything_else_is_refused_naming_the_variable(raw):
    with pytest.raises(InputError, match="OFFLOAD_ENGINE_IO_PROBE"):
        parse_flag("OFFLOAD_ENGINE_IO_PROBE", raw, True)


@pytest.fixture
def tiny_probe(monkeypatch):
    """A probe (what the old code ran for "false") of 1 MiB, not 256 MiB per case."""
    monkeypatch.setattr(dp, "PROBE_BYTES", 1 << 20)
    monkeypatch.setattr(dp, "REQUEST_BYTES", 256 << 10)
    monkeypatch.setattr(dp, "CASES", (("buffered", 2, 64 << 10, 1),))


def test_io_probe_false_turns_probing_off(tmp_path, monkeypatch, tiny_probe):
    monkeypatch.setenv(dp.PROFILE_DIR_ENV, str(tmp_path / "profiles"))
    monkeypatch.setenv(dp.PROBE_ENV, "false")
    dp.forget_memo()
    before = dp.probes_run
    assert dp.choose(str(tmp_path))["source"] == "default"
    assert dp.probes_run == before


def test_io_probe_misspelled_is_an_error_not_a_probe(tmp_path, monkeypatch, tiny_probe):
    monkeypatch.setenv(dp.PROFILE_DIR_ENV, str(tmp_path / "profiles"))
    monkeypatch.setenv(dp.PROBE_ENV, "flase")
    dp.forget_memo()
    before = dp.probes_run
    with pytest.raises(InputError, match="OFFLOAD_ENGINE_IO_PROBE='flase'"):
        dp.choose(str(tmp_path))
    assert dp.probes_run == before


def test_huge_pages_off_spellings(monkeypatch):
    monkeypatch.setenv(align.HUGE_PAGES_ENV, "Off")
    assert align.huge_pages_wanted() is False
    monkeypatch.setenv(align.HUGE_PAGES_ENV, "maybe")
    with pytest.raises(InputError, match="OFFLOAD_ENGINE_HUGE_PAGES"):
        align.huge_pages_wanted()
