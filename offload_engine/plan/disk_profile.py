"""Measured disk settings and bandwidth, cached per device.

``offload-engine bench disk --path DIR`` sweeps block size, queue depth and threads through
the engine's own I/O path and saves the best point here; ``offload-engine plan --nvme DIR``
reads it back. One JSON file per device:
``$OFFLOAD_ENGINE_CACHE_DIR`` (or ``$XDG_CACHE_HOME/offload-engine``, or
``~/.cache/offload-engine``) ``/disk-<device id>.json``. The device id is the
``major-minor`` of the file system's device (``os.stat(path).st_dev``) followed by the
drive's model (or serial) from ``/sys/dev/block/<major>:<minor>``, when there is one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile

from ..jsonlimits import read_json_file
from ..units import MiB

log = logging.getLogger(__name__)

FORMAT = "offload-engine-disk-profile"
FORMAT_VERSION = 1
CACHE_ENV = "OFFLOAD_ENGINE_CACHE_DIR"
# A cached profile is a few KB (the best point and a sweep of ~50 points); anyone who can
# write the cache folder wrote it, so it is read bounded and checked (``load_profile``).
MAX_CACHE_BYTES = 1 * MiB
MAX_FIGURE = 1 << 62  # no bandwidth, block size or depth comes near it; bounds the arithmetic


def cache_dir() -> str:
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "offload-engine")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def device_info(path: str) -> dict:
    """What identifies the device holding ``path``: major, minor, model, name, size."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    sys_dir = f"/sys/dev/block/{major}:{minor}"
    info = {"major": major, "minor": minor, "model": None, "serial": None, "name": None,
            "size_bytes": None, "rotational": None}
    if os.path.isdir(sys_dir):
        disk = sys_dir
        if os.path.exists(os.path.join(sys_dir, "partition")):  # a partition: ask its disk
            disk = os.path.realpath(os.path.join(sys_dir, ".."))
        info["model"] = _read(os.path.join(disk, "device", "model")) or _read(os.path.join(disk, "dm", "name"))
        info["serial"] = _read(os.path.join(disk, "serial")) or _read(os.path.join(disk, "device", "serial"))
        uevent = _read(os.path.join(sys_dir, "uevent")) or ""
        m = re.search(r"^DEVNAME=(\S+)$", uevent, re.M)
        info["name"] = m.group(1) if m else None
        size = _read(os.path.join(sys_dir, "size"))
        info["size_bytes"] = int(size) * 512 if size and size.isdigit() else None
        rot = _read(os.path.join(disk, "queue", "rotational"))
        info["rotational"] = (rot == "1") if rot in ("0", "1") else None
    return info


def device_id(path: str, info: dict | None = None) -> str:
    info = info or device_info(path)
    label = info.get("model") or info.get("serial")
    base = f"{info['major']}-{info['minor']}"
    if label:
        base += "-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_")
    return base


def profile_path(path: str) -> str:
    """The cache file for the device holding ``path``."""
    return os.path.join(cache_dir(), f"disk-{device_id(path)}.json")


def save_profile(path: str, profile: dict) -> str:
    """Write ``profile`` (the best point and the sweep) as the cache entry of ``path``'s device."""
    info = device_info(path)
    doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "device_id": device_id(path, info),
           "device": info, **profile}
    target = os.path.join(cache_dir(), f"disk-{doc['device_id']}.json")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".disk-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def load_profile(path: str) -> dict | None:
    """The cached profile of ``path``'s device, or None when there is none. One that is
    unreadable, of another format, not a regular file, over ``MAX_CACHE_BYTES``, not strict
    JSON or without positive finite figures is ignored with a warning naming it, never
    trusted and never a crash (docs/untrusted-input.md)."""
    try:
        file = profile_path(path)
        if not os.path.exists(file):
            return None
    except OSError:
        return None
    try:
        doc = read_json_file(file, MAX_CACHE_BYTES, what="disk profile", max_depth=8)
    except (OSError, ValueError) as e:
        log.warning("ignoring a bad disk profile: %s", e)
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or \
            doc.get("format_version") != FORMAT_VERSION:
        return None
    best = doc.get("best")
    if not isinstance(best, dict) or not all(
            type(best.get(k)) in types and 0 < best.get(k) <= MAX_FIGURE
            for k, types in (("read_gbps", (int, float)), ("write_gbps", (int, float)),
                             ("block_size", (int,)), ("queue_depth", (int,)),
                             ("io_threads", (int,)))):
        log.warning("ignoring a bad disk profile: %s: 'best' needs positive numbers read_gbps "
                    "and write_gbps and positive integers block_size, queue_depth and "
                    "io_threads", file)
        return None
    doc["file"] = file
    return doc
