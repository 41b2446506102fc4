"""The store's I/O settings per direction: the config's fields where set, else the device
profile's choice (io/device_profile.py), else the built-in default; and where each came from.
"""

from __future__ import annotations

from ..io import device_profile
from ..io.adaptive import AdaptiveIO, candidates_from
from ..io.settings import DEFAULT, DIRECTIONS, FIELDS, DirectionSettings
from .config import StoreConfig

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
