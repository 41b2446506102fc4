"""The store's I/O settings per direction: the config's fields where set, else the device
profile's choice (io/device_profile.py), else the built-in default; where each came from;
and, while the store runs, the adaptive controllers' changes (``IOSettings``).
"""

from __future__ import annotations

import logging

from ..io import device_profile
from ..io.adaptive import AdaptiveIO, candidates_from
from ..io.settings import DEFAULT, DIRECTIONS, FIELDS, DirectionSettings
from .config import StoreConfig

log = logging.getLogger(__name__)

# bytes a direction moves between two decisions of the adaptive controller: enough that
# one slow request does not count as a slower device
ADAPT_WINDOW_BYTES = 1 << 30
MAX_THREADS = 64


def resolve(cfg: StoreConfig, directory: str | None) -> dict:
    """``{"read": DirectionSettings, "write": ..., "threads": int, "report": dict,
    "controllers": {op: AdaptiveIO}}`` for a store whose files live under ``directory``
    (None: no NVMe tier, no profile needed)."""
    explicit = cfg.model_fields_set
    config_key = {"queue_depth": "queue_depth", "block_bytes": "block_size",
                  "streams": "io_streams"}
    fixed_fields = {f for f, key in config_key.items() if key in explicit}
    need_profile = directory is not None and (
        "auto" in (cfg.read_mode, cfg.write_mode) or len(fixed_fields) < len(config_key))
    profile = device_profile.choose(directory) if need_profile else device_profile.default_profile()
    psource = "profile" if profile["source"] in ("cache", "probe") else "default"
    out, report, controllers = {}, {}, {}
    for op in DIRECTIONS:
        chosen = device_profile.settings_of(profile, op, psource)
        mode_key = f"{op}_mode"
        fixed = set(fixed_fields)
        sources = dict.fromkeys(FIELDS, psource)
        values = dict(zip(FIELDS, chosen.shape()))
        if getattr(cfg, mode_key) != "auto":
            values["mode"], sources["mode"] = getattr(cfg, mode_key), "config"
            fixed.add("mode")
        for f in fixed_fields:
            values[f], sources[f] = getattr(cfg, config_key[f]), "config"
        source = "config" if "config" in sources.values() else psource
        st = DirectionSettings(**values, source=source)
        out[op] = st
        report[op] = {**{k: v for k, v in st.as_dict().items()}, "sources": sources}
        if cfg.adaptive_io and directory is not None and len(fixed) < len(FIELDS):
            cands = candidates_from(profile if psource == "profile" else {}, op, st, fixed)
            if len(cands) > 1:
                controllers[op] = AdaptiveIO(cands, window_bytes=ADAPT_WINDOW_BYTES)
    # enough threads for the deepest queue any candidate may step to
    deepest = [DEFAULT.queue_depth, out["read"].queue_depth, out["write"].queue_depth]
    deepest += [c.queue_depth for ctl in controllers.values() for c in ctl.candidates]
    threads = cfg.io_threads if "io_threads" in explicit else min(max(deepest), MAX_THREADS)
    report["threads"] = {"value": threads, "source": "config" if "io_threads" in explicit else "derived"}
    report["profile"] = {"source": profile["source"], "file": profile.get("file"),
                         "measured_at": profile.get("measured_at")}
    report["adaptive"] = sorted(controllers)
    return {"read": out["read"], "write": out["write"], "threads": threads, "report": report,
            "controllers": controllers}


def describe_change(op: str, old: DirectionSettings, new: DirectionSettings, why: str) -> str:
    return f"adaptive I/O: {op} {old.describe()} -> {new.describe()} ({why})"


class IOSettings:
    """The I/O settings a store uses now, per direction, where each came from, and the
    adaptive controllers (io/adaptive.py) that change them between steps.

    Args:
        io: the store's AsyncFileIO, whose settings this changes.
        report: ``resolve(...)["report"]``; kept up to date.
        controllers: ``resolve(...)["controllers"]``: {op: AdaptiveIO}.
    """

    def __init__(self, io, report: dict, controllers: dict):
        self._io = io
        self._report = report
        self._controllers = controllers
        self._seen = {"read": (0, 0.0), "write": (0, 0.0)}  # bytes moved, busy seconds

    def adapt(self) -> None:
        """Feed each direction's controller what moved since the last call (bytes, busy
        seconds) and apply the settings it steps to. The store calls it once per step."""
        st = self._io.stats
        for op, ctl in self._controllers.items():
            moved = st.bytes_read if op == "read" else st.bytes_written
            busy = st.read_busy_s if op == "read" else st.write_busy_s
            last_moved, last_busy = self._seen[op]
            self._seen[op] = (moved, busy)
            new = ctl.feed(moved - last_moved, busy - last_busy)
            if new is not None:
                log.info("%s", describe_change(op, *ctl.changes[-1]))
                self.set(op, new)

    def set(self, op: str, settings: DirectionSettings) -> None:
        """Use ``settings`` for ``op`` ("read" or "write") from now on."""
        self._io.set_settings(op, settings)
        self._report[op] = {**settings.as_dict(), "sources": {k: settings.source for k in FIELDS}}

    def report(self) -> dict:
        """The I/O settings in force per direction and where they came from: {"read":
        {"mode", "queue_depth", "block_bytes", "streams", "source", "sources"}, "write": ...,
        "threads", "profile": {"source", "file", "measured_at"}, "adaptive": directions
        watched, "changes": how many times the adaptive controller stepped}."""
        out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self._report.items()}
        out["changes"] = sum(len(c.changes) for c in self._controllers.values())
        return out
