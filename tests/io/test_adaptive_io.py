"""The adaptive I/O controller, driven by synthetic samples (bytes, busy seconds)."""

import pytest

from offload_engine.io.adaptive import AdaptiveIO, candidates_from
from offload_engine.io.settings import DirectionSettings

GB = 10**9
DIRECT = DirectionSettings("direct", 8, 8 << 20, "profile")
BUFFERED = DirectionSettings("buffered", 8, 8 << 20, "adaptive")
DEEP = DirectionSettings("direct", 16, 1 << 20, "adaptive")


def _ctl(**kw):
    return AdaptiveIO([DIRECT, BUFFERED, DEEP], window_bytes=GB, **kw)


def _window(ctl, gbps):
    """One window's worth of samples at ``gbps``; what the controller answered last."""
    out = None
    for _ in range(4):
        out = ctl.feed(GB // 4, 0.25 / gbps) or out
    return out


def test_a_steady_device_changes_nothing():
    ctl = _ctl()
    for g in (1.0, 0.95, 1.05, 0.9, 1.0, 0.98):
        assert _window(ctl, g) is None
    assert ctl.current is DIRECT and ctl.changes == []


def test_one_slow_window_is_noise_two_start_a_trial_and_the_fastest_is_kept():
    ctl = _ctl()
    _window(ctl, 1.0)
    assert _window(ctl, 0.5) is None            # once: noise
    assert _window(ctl, 1.0) is None
    assert _window(ctl, 0.5) is None
    assert _window(ctl, 0.55) is BUFFERED       # twice in a row: try the others
    assert _window(ctl, 0.9) is DEEP            # buffered measured 0.9
    assert _window(ctl, 0.7) is BUFFERED        # deep 0.7: buffered was fastest
    assert ctl.current is BUFFERED and ctl.reference == pytest.approx(0.9 * GB)
    assert [c[2] for c in ctl.changes] == ["trial", "trial", "fastest in trial"]
    assert _window(ctl, 0.88) is None           # the new normal


def test_the_current_setting_stays_when_it_is_still_the_fastest():
    ctl = _ctl()
    _window(ctl, 1.0)
    _window(ctl, 0.5)
    assert _window(ctl, 0.6) is BUFFERED
    assert _window(ctl, 0.3) is DEEP
    assert _window(ctl, 0.59) is DIRECT         # the trial's first window: 0.6 on DIRECT
    assert ctl.current is DIRECT


def test_samples_smaller_than_a_window_accumulate():
    ctl = _ctl()
    for _ in range(999):
        assert ctl.feed(GB // 1000, 0.001) is None
    assert ctl.reference is None
    ctl.feed(GB // 1000, 0.001)
    assert ctl.reference == pytest.approx(GB)
    assert ctl.feed(0, 1.0) is None and ctl.feed(5, 0) is None  # idle samples are ignored


def test_candidates_keep_the_fields_the_config_fixed():
    profile = {"points": [
        {"mode": "buffered", "queue_depth": 16, "block_bytes": 1 << 20, "read_gbps": 2.0},
        {"mode": "direct", "queue_depth": 4, "block_bytes": 8 << 20, "read_gbps": 1.0},
        {"mode": "direct", "queue_depth": 16, "block_bytes": 1 << 20, "read_gbps": 1.5}]}
    chosen = DirectionSettings("direct", 4, 8 << 20, "config")
    got = candidates_from(profile, "read", chosen, fixed={"mode"})
    assert got[0] is chosen and {c.mode for c in got} == {"direct"}
    assert [(c.queue_depth, c.block_bytes) for c in got[1:]] == [(16, 1 << 20)]
    assert candidates_from({}, "read", chosen, fixed=set())[1].mode == "buffered"
    assert len(candidates_from({}, "read", chosen, fixed={"mode"})) == 1
