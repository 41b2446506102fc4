"""What a cached I/O profile must hold to be used (io/device_profile.py reads the cache).

The cache folder is writable by whoever shares the machine or the home directory, so its
files are untrusted: a profile is used only when its settings and measured points (all
that the store and adaptive I/O read from it) have the types and ranges a probe writes.
"""

from __future__ import annotations

from ..errors import InputError
from ..units import MiB
from .align import ALIGN
from .settings import DIRECTIONS, MODES

FORMAT = "offload-engine-io-profile"
# What a cached profile may hold (``check_profile``): a probe writes ~10 KB of two choices and
# ~20 points, nested 3 deep; the store's own limits on queue depth (1024) and a piece size of
# 1 GiB bound what a cache can make the store allocate per request.
MAX_CACHE_POINTS = 1024
MAX_CACHE_QUEUE_DEPTH = 1024
MAX_CACHE_BLOCK_BYTES = 1024 * MiB


def check_profile(doc, file: str) -> None:
    """Raise ``InputError`` naming ``file`` unless ``doc`` is a profile of this version
    whose settings and measured points (all that the store and adaptive I/O read from it)
    have the types and ranges a probe writes."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise InputError(f"{file}: not an {FORMAT} document")
    for op in DIRECTIONS:
        _check_settings(doc.get(op), f"{file}: {op}")
    points = doc.get("points", [])
    if not isinstance(points, list) or len(points) > MAX_CACHE_POINTS:
        raise InputError(f"{file}: points must be a list of at most {MAX_CACHE_POINTS}")
    for i, p in enumerate(points):
        _check_settings(p, f"{file}: points[{i}]")
        for op in DIRECTIONS:
            gbps = p.get(f"{op}_gbps", 0)
            if type(gbps) not in (int, float) or not 0 <= gbps < 1e6:
                raise InputError(f"{file}: points[{i}].{op}_gbps must be a number of GB/s")
    if not isinstance(doc.get("measured_at", ""), (str, int, float)):
        raise InputError(f"{file}: measured_at must be a string")


def _check_settings(d, where: str) -> None:
    if not isinstance(d, dict):
        raise InputError(f"{where}: expected an object of I/O settings")
    if d.get("mode") not in MODES:
        raise InputError(f"{where}.mode must be one of {MODES}")
    for key, top in (("queue_depth", MAX_CACHE_QUEUE_DEPTH), ("streams", MAX_CACHE_QUEUE_DEPTH),
                     ("block_bytes", MAX_CACHE_BLOCK_BYTES)):
        value = d.get(key, 1) if key == "streams" else d.get(key)
        if type(value) is not int or not 1 <= value <= top:
            raise InputError(f"{where}.{key} must be an integer in [1, {top}]")
    if d["block_bytes"] % ALIGN:
        raise InputError(f"{where}.block_bytes must be a multiple of {ALIGN}")
